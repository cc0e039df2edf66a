"""Chaos, driver kills: the training job's driver SIGKILLed at random steps and resumed, then exactly-once
checked from what persists.

    python -m jobs.chaos --config configs/tiny_cpu.yaml --driver-kills N --json PATH [--seed S] [key=value ...]

`run_driver_kills` (called by jobs/chaos.py) runs `python -m jobs.train` as a subprocess on its own local
Ray, in `<train.output_dir>/driver_kills`. It watches `metrics.jsonl` and, once the row of a seeded random
step appears, waits a random part of a step and kills the driver with SIGKILL (so the kill lands
mid-rollout, mid-training, mid-evaluation or mid-checkpoint), N times, each time at a later step. Each
run after a kill is `train.resume=true`; the last one runs to the end. Then it checks, from what persists
only:

- the final checkpoint's prompt cursor and store (driver/checkpoint.py) and the job's per-step records
  (`groups.jsonl`, driver/records.py: the groups returned for training and dropped by the filter at each
  step, cut back to the checkpoint at each resume): every group the cursor handed out is trained,
  dropped or stored exactly once (`prompts_consumed_twice`, `prompts_skipped`; a group id is a prompt of
  one epoch), and no sample is trained twice;
- `metrics.jsonl`: every step once, and the policy versions 1, 2, ... without a gap or a repeat;
- with the agent task, its log of tool runs (each with its call's key, which binds it to its trajectory)
  against the job's tool journal as each kill left it: no call whose result was journaled runs again
  (`tool_calls_run_twice`); a call running when the kill took the whole job and run again with the same
  key (its trajectory replayed) is counted apart (`tool_calls_rerun_unjournaled`); and episodes come back
  from the checkpointed store at their turn (`episodes_resumed_after_restart`);
- the processes under each killed driver (its local Ray), recorded just before the kill: those still
  running at the end are `stray_processes`.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import psutil

from driver.checkpoint import find_checkpoint, read_state
from driver.records import TRAINING_SAMPLE, read_rows, taken_group_ids

ROOT = Path(__file__).resolve().parents[1]


def run_driver_kills(cfg, args, env: dict | None = None) -> dict:
    """`args.driver_kills` SIGKILLs of the driver, each resumed; the drivers run in `env` (default: this
    process's environment)."""
    out = Path(cfg.train.output_dir) / "driver_kills"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    n, kills = cfg.train.num_steps, args.driver_kills
    if n - 3 < kills:
        raise ValueError(f"--driver-kills {kills}: train.num_steps={n} leaves room for at most {max(0, n - 3)} "
                         f"kills (after steps 1 .. num_steps-3, so that a step is left to be killed in)")
    rng = random.Random(args.seed)
    at_steps = sorted(rng.sample(range(1, n - 2), kills))
    if at_steps and cfg.train.save_every > at_steps[-1]:
        print(f"chaos: train.save_every={cfg.train.save_every}: the kills (after steps {at_steps}) fall before the "
              f"first checkpoint, so every resume starts from step 0", flush=True)
    cmd = [sys.executable, "-m", "jobs.train", *(["--config", args.config] if getattr(args, "config", None) else []),
           *getattr(args, "overrides", []), f"train.output_dir={out}"]
    env = {**(os.environ if env is None else env), "RAY_ADDRESS": "",  # each driver starts a local Ray of its own
           "APRIL_RAY_TOOL_LOG": str((out / "tool_calls.jsonl").resolve())}  # the agent task's call log
    t0, runs, watched, at_kills, killed_at = time.time(), [], [], [], None
    for i, at in enumerate([*at_steps, None]):
        run = Run(cmd + (["train.resume=true"] if i else []), out / f"run{i}.log", env, out / "metrics.jsonl")
        if at is None:
            runs.append(run.finish())
        else:
            runs.append(run.kill_after(at, rng))
            watched += run.watched
            at_kills.append(ToolRecords.read(out))
        if killed_at is not None:  # from the kill to the resumed job's first step (a person's delay: none)
            runs[-1]["recovery_s"] = run.first_row and round(run.first_row - killed_at, 1)
        killed_at = run.killed_at
    time.sleep(2.0)  # a killed run's processes had minutes; this is only for the last one's watchdog
    stray = [f"{p.pid} {name(p)}" for p in watched if p.is_running()]
    result = {"driver_kills": kills, "driver_kill_steps": at_steps, "runs": runs, "stray_processes": len(stray),
              "stray_process_names": stray[:20], "wall_s": time.time() - t0} | check_exactly_once(out, cfg)
    result |= tool_calls_across_kills(ToolRecords.read(out), at_kills) | episodes_after_resumes(out, runs)
    result["ok"] = (result.get("ok", True) and not result["prompts_consumed_twice"] and not result["prompts_skipped"]
                    and not result["samples_trained_twice"] and result["steps_completed"] == n
                    and not result["stray_processes"] and result["metrics_steps_ok"]
                    and not result["tool_calls_run_twice"])
    return result


def name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return "?"


class Run:
    """One driver subprocess in `env`, its output in `log`, its step rows appended to `metrics`."""

    def __init__(self, cmd: list[str], log: Path, env: dict, metrics: Path):
        self.log, self.metrics = log, metrics
        self.before = {line for line, _ in step_rows(metrics)}  # earlier runs': this run's are the lines not in it
        self.new: dict[int, float] = {}
        """Step -> when this run's row of it was first seen."""
        self.file = open(log, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.file, stderr=subprocess.STDOUT, env=env)
        self.watched: list[psutil.Process] = []
        self.t0 = time.time()
        self.killed_at: float | None = None

    @property
    def first_row(self) -> float | None:
        """When this run's first step row was seen."""
        return min(self.new.values(), default=None)

    def _watch(self) -> None:
        for line, step in step_rows(self.metrics):
            if line not in self.before:
                self.new.setdefault(step, time.time())

    def kill_after(self, at: int, rng: random.Random, timeout_s: float = 1800) -> dict:
        """SIGKILL the driver a random part of a step after the row of step `at` is written."""
        new = self.new
        while at not in new:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the driver exited ({self.proc.returncode}) before step {at}; see {self.log}:\n"
                                   + self.log.read_text()[-3000:])
            if time.time() - self.t0 > timeout_s:
                self.proc.kill()
                raise TimeoutError(f"step {at} not reached within {timeout_s:.0f}s; see {self.log}")
            self._watch()
            time.sleep(0.1)
        times = sorted(new.values())  # rows this run wrote: their spacing is a step's time
        gaps = sorted(b - a for a, b in zip(times, times[1:]))
        delay = rng.uniform(0, gaps[len(gaps) // 2] if gaps else 1.0)
        time.sleep(delay)
        if self.proc.poll() is not None:
            raise RuntimeError(f"the driver ended ({self.proc.returncode}) before its kill, {delay:.1f}s after step "
                               f"{at}; see {self.log}")
        self.watched = [p for p in psutil.Process(self.proc.pid).children(recursive=True)]
        os.kill(self.proc.pid, signal.SIGKILL)
        self.killed_at = time.time()
        self.proc.wait()
        self.file.close()
        psutil.wait_procs(self.watched, timeout=30)  # the job's processes end with it (the tool journal's too)
        print(f"chaos: SIGKILL of the driver {delay:.2f}s after step {at} ({len(self.watched)} processes under it)",
              flush=True)
        return {"killed_after_step": at, "delay_s": round(delay, 3), "resumed_from": resumed_from(self.log),
                "processes": len(self.watched), "wall_s": round(time.time() - self.t0, 1)}

    def finish(self, timeout_s: float = 3600) -> dict:
        try:
            while self.proc.poll() is None and time.time() - self.t0 < timeout_s:
                if not self.new:  # only its first row is wanted here (`first_row`)
                    self._watch()
                time.sleep(0.2)
            code = self.proc.wait(1)
        finally:
            self.file.close()
        if code != 0:
            raise RuntimeError(f"the last run failed ({code}); see {self.log}:\n" + self.log.read_text()[-3000:])
        return {"finished": True, "resumed_from": resumed_from(self.log), "wall_s": round(time.time() - self.t0, 1)}


def resumed_from(log: Path) -> str | None:
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("resumed from "):
            return Path(line.split()[2].rstrip(":")).name
    return None


def step_rows(metrics: Path) -> list[tuple[str, int]]:
    """(line, step) of each training row in metrics.jsonl (a torn last line is skipped)."""
    rows = []
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if "train/version" in row:
                rows.append((line, row["step"]))
    return rows


@dataclass(frozen=True)
class ToolRecords:
    """The agent task's log of tool runs (one line per run, with its call's key: `rollout/episode.py`'s
    `tool_key`, handed to the tool as its idempotency key) and the keys of the results the job's tool journal
    recorded, read together: after a kill, once the job's processes are gone, they are what the next run
    starts from."""

    runs: tuple[str, ...]
    journaled: frozenset[str]

    @classmethod
    def read(cls, out: Path) -> "ToolRecords":
        log, journal = out / "tool_calls.jsonl", out / "tool_journal.jsonl"
        runs = [r["call"] for r in read_jsonl(log) if TRAINING_SAMPLE.fullmatch(r["sample"])]
        return cls(tuple(runs), frozenset(entry[0] for entry in read_jsonl(journal)))


def read_jsonl(path: Path) -> list:
    """The whole lines of a JSONL file that a kill may have cut mid-line (a torn last line is skipped)."""
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def tool_calls_across_kills(final: ToolRecords, at_kills: list[ToolRecords]) -> dict:
    """Training tool calls run more than once under one key, told apart by what the journal held when the
    run before was killed. A call whose result was journaled is final: running it again is an error
    (`tool_calls_run_twice`). A call that was running when SIGKILL took the whole job (the tool ran, its
    result never reached the journal) is run again by the resumed job: counted apart
    (`tool_calls_rerun_unjournaled`); a tool with side effects has to be idempotent for those."""
    counts = Counter(final.runs)
    twice = sum(c - 1 for c in counts.values() if c > 1)
    rerun_unjournaled = 0
    for kill in at_kills:
        before = Counter(kill.runs)
        after = Counter(final.runs) - before  # runs since this kill (the log only grows)
        rerun_unjournaled += sum(min(c, before[k]) for k, c in after.items() if k in before and k not in kill.journaled)
    return {"tool_calls": len(final.runs), "tool_calls_run_twice": twice - rerun_unjournaled,
            "tool_calls_rerun_unjournaled": rerun_unjournaled}


def episodes_after_resumes(out: Path, runs: list[dict]) -> dict:
    """Episodes taken from the store mid-trajectory in the first step of each resumed run (they were
    interrupted before the kill, saved in the checkpoint, and go on at their turn)."""
    rows = {r["step"]: r for r in (json.loads(line) for line, _ in step_rows(out / "metrics.jsonl"))}
    first = [int(r["resumed_from"].rsplit("-", 1)[1]) + 1 for r in runs if r.get("resumed_from")]
    return {"episodes_resumed_after_restart": [rows.get(s, {}).get("rollout/episodes_resumed", 0) for s in first]}


def check_exactly_once(out: Path, cfg) -> dict:
    ckpt = find_checkpoint(out, log=lambda _: None)
    state = read_state(ckpt)
    rows = [r for r in read_rows(out) if "end" not in r]
    returned = Counter(g for r in rows for g in r["returned"])
    dropped = Counter(g for r in rows for g in r["dropped"])
    stored = Counter(g["group_id"] for kind in ("partial", "complete") for g in state["store"][kind])
    placed = returned + dropped + stored
    taken = taken_group_ids(state["source"])
    samples = Counter(s for r in rows for ids in r.get("samples", {}).values() for s in ids)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in metrics if "train/version" in r]
    versions = [r["train/version"] for r in metrics if "train/version" in r]
    n = cfg.train.num_steps
    return {
        "steps": n, "steps_completed": len({r["step"] for r in rows}),
        "final_checkpoint": ckpt.name, "groups_taken": len(taken), "groups_returned": sum(returned.values()),
        "groups_dropped": sum(dropped.values()), "groups_stored": sum(stored.values()),
        "prompts_consumed_twice": sum(c - 1 for c in placed.values() if c > 1),
        "prompts_skipped": sum(1 for g in taken if g not in placed),
        "unknown_groups": len(set(placed) - set(taken)),
        "samples_trained_twice": sum(c - 1 for c in samples.values() if c > 1),
        "group_rows_per_step_ok": sorted(r["step"] for r in rows) == list(range(n)),
        "metrics_steps_ok": steps == list(range(n)) and versions == list(range(1, n + 1)),
    }
