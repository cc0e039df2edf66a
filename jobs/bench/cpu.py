"""CPU seconds per training step of each role of a job: the engines' processes, the learner's, and
everything else the job runs (the driver, the monitor, the store, Ray's own processes), so a benchmark
can say how close a step comes to what the machine's cores allow.

A sampler thread reads, about once a second, the CPU time (user + system) of this process and all its
descendants (a local Ray's workers among them), each named by its process title (`ray::LearnerActor.train`:
role `learner`); it keeps the samples of processes that end, as the job's actors do when it shuts down.
Afterwards the CPU time spent inside chosen windows of time (a run's training loop less its evaluations)
is read off by interpolating each process's cumulative CPU time between samples. The whole machine's busy
CPU time over the same windows (`machine`: other users' processes too) shows what the job shared.
"""
from __future__ import annotations

import bisect
import os
import threading
import time

import psutil

ROLES = {"ray::EngineWorkerActor": "engines", "ray::LearnerActor": "learner"}
"""Process-title prefixes -> role; every other process of the job is `other`."""


def role_of(title: str) -> str | None:
    """The role a process title names; None for an idle Ray worker (not yet an actor: look again later).
    A worker's title names its actor only once the actor is placed on it (before: `python ...
    default_worker.py`, then `ray::IDLE`), so a process's role is the last one seen until it names one."""
    if title.startswith("ray::IDLE"):
        return None
    return next((role for prefix, role in ROLES.items() if title.startswith(prefix)), "other")


class Series:
    """One cumulative CPU-seconds counter sampled over time, read at any instant by linear interpolation
    (before its first sample: the value it started from; after its last: its last value)."""

    def __init__(self, t: float, value: float):
        self.t, self.v = [t], [value]

    def add(self, t: float, value: float) -> None:
        self.t.append(t)
        self.v.append(value)

    def at(self, t: float) -> float:
        i = bisect.bisect_right(self.t, t)
        if i == 0:
            return self.v[0]
        if i == len(self.t):
            return self.v[-1]
        t0, t1, v0, v1 = self.t[i - 1], self.t[i], self.v[i - 1], self.v[i]
        return v0 + (v1 - v0) * (t - t0) / max(1e-9, t1 - t0)

    def within(self, windows: list[tuple[float, float]]) -> float:
        return sum(self.at(b) - self.at(a) for a, b in windows)


class JobCpu:
    """Samples the CPU times of this process's tree (by role) and of the machine while it runs
    (`with JobCpu() as cpu: ...`); `cpu.within(windows)` -> CPU seconds by role in those windows."""

    def __init__(self, period_s: float = 1.0, root: psutil.Process | None = None):
        self.period_s = period_s
        self.root = root or psutil.Process()  # the tree sampled: this process's by default
        self.procs: dict[tuple[int, float], tuple[str, Series]] = {}  # (pid, create time) -> (role, series)
        self.machine: Series | None = None
        self.last_t: float | None = None  # the previous sample's instant
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="job-cpu", daemon=True)

    def __enter__(self) -> "JobCpu":
        self.sample()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.sample()

    def _run(self) -> None:
        while not self.stop.wait(self.period_s):
            self.sample()

    def sample(self) -> None:
        now = time.perf_counter()
        busy = psutil.cpu_times()
        total = sum(busy) - busy.idle - getattr(busy, "iowait", 0.0)
        if self.machine is None:
            self.machine = Series(now, total)
        else:
            self.machine.add(now, total)
        try:
            tree = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:  # the root ended
            tree = []
        for p in tree:
            try:
                with p.oneshot():
                    key, cpu = (p.pid, p.create_time()), p.cpu_times()
                    title = (p.cmdline()[:1] or [p.name()])[0]
            except psutil.Error:
                continue
            seconds = cpu.user + cpu.system
            role = role_of(title)
            if key not in self.procs:
                # a process first seen now started since the last sample: it was at 0 s then
                series = Series(now, seconds) if self.last_t is None else Series(self.last_t, 0.0)
                self.procs[key] = (role, series)
            old_role, series = self.procs[key]
            series.add(now, seconds)
            if old_role not in ("engines", "learner"):  # a worker starting up or idle is not yet its actor
                self.procs[key] = (role or old_role, series)
        self.last_t = now

    def within(self, windows: list[tuple[float, float]]) -> dict[str, float]:
        """CPU seconds in `windows` ((start, end) perf_counter instants) by role, and the machine's."""
        out = {"engines": 0.0, "learner": 0.0, "other": 0.0}
        for role, series in self.procs.values():
            out[role or "other"] += series.within(windows)
        out["machine"] = self.machine.within(windows) if self.machine else 0.0
        return out


def training_windows(rows: list[dict], t0: float) -> list[tuple[float, float]]:
    """The training loop's spans less its evaluations, as perf_counter instants, from a run's step rows
    (`time/wall_s` since the loop's start `t0`, `time/eval_s` of the steps that evaluated: the evaluation
    ends just before its step's row is logged)."""
    windows, start = [], t0
    for r in rows:
        end = t0 + r["time/wall_s"]
        eval_s = r.get("time/eval_s", 0.0)
        windows.append((start, end - eval_s))
        start = end
    return windows


def per_step(cpu: dict[str, float], steps: int) -> dict[str, float]:
    """CPU seconds per step by role, and the step time they imply at the least on this machine's cores
    (`floor_s`: the job's CPU seconds over `os.cpu_count()`)."""
    out = {role: s / max(1, steps) for role, s in cpu.items()}
    out["floor_s"] = (out["engines"] + out["learner"] + out["other"]) / (os.cpu_count() or 1)
    return out
