"""Jobs that session fixtures share, started ahead of the tests that read them. A job's phases are mostly one
process at a time (the driver's imports, Ray's start, each actor's imports), so on two cores a job leaves
about a core idle: the suite's other tests use it meanwhile. `shared_job` declares one, in conftest.py or in
the test module that reads it; the longest jobs start first, then in the order the collected tests first
ask for them, two at a time in background threads, and a fixture asked for before its job started runs it
itself. Only the jobs some collected test asks for are run (`pytest tests/test_config.py` starts none)."""
from __future__ import annotations

import functools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import pytest

JOBS: dict[str, Callable] = {}
"""Every shared job by its fixture's name: `job(tmp_path_factory, model_dir)` -> what its tests read."""

WORKERS = 2
"""Jobs run at once in the background (each also starts a local Ray of its own)."""


RUNS: dict[str, int] = {}
"""How many training jobs (or runs of a job's size) each shared job runs one after another."""


def shared_job(job: Callable | None = None, *, runs: int = 1):
    """`job(tmp_path_factory, model_dir)` as the session fixture of its name, its job run once and started
    ahead: a job runs in a background thread, so it changes no process-wide state (no chdir, no
    monkeypatch) and builds its paths from ROOT. `@shared_job(runs=N)` for one that runs N jobs one after
    another: the longest start first, so that none is left running alone at the end."""
    if job is None:
        return lambda job: shared_job(job, runs=runs)
    JOBS[job.__name__] = job
    RUNS[job.__name__] = runs

    @pytest.fixture(scope="session", name=job.__name__)
    def fixture(prefetched, tmp_path_factory, random_model_dir):
        return prefetched.result(job.__name__, functools.partial(job, tmp_path_factory, random_model_dir))

    return fixture


def wanted(item) -> set[str]:
    """The fixtures `item` asks for, by name: its arguments', and a parameter naming one (getfixturevalue)."""
    callspec = getattr(item, "callspec", None)
    params = callspec.params.values() if callspec is not None else ()
    return set(item.fixturenames) | {p for p in params if isinstance(p, str)}


def first_asked(names, items) -> list[str]:
    """The `names` that `items` (the collected tests, in run order) ask for: the longest first (`RUNS`),
    then first asked first."""
    first = {}
    for i, item in enumerate(items):
        if item.get_closest_marker("skip") is None:
            for name in wanted(item) & set(names):
                first.setdefault(name, i)
    return sorted(first, key=lambda name: (-RUNS.get(name, 1), first[name]))


class Prefetch:
    def __init__(self, workers: int = WORKERS):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="prefetch")
        self._futures: dict[str, Future] = {}
        self.t0 = time.monotonic()
        self.times: dict[str, list[float]] = {}
        """Each job's [start, end, seconds its first reader waited] (seconds from the session's start), and
        where it ran: what the suite's summary prints (conftest.py), to see which side ends the run."""

    def submit(self, name: str, run: Callable[[], object]) -> None:
        self._futures[name] = self._pool.submit(self._timed, name, run, "background")

    def result(self, name: str, run: Callable[[], object]):
        """The job's result, waited for; `run()` here when it was never queued or had not started yet."""
        future = self._futures.pop(name, None)
        if future is None or future.cancel():
            return self._timed(name, run, "foreground")
        asked = time.monotonic()
        try:
            return future.result()
        finally:
            self.times[name][2] = time.monotonic() - asked

    def _timed(self, name: str, run: Callable[[], object], where: str):
        self.times[name] = [time.monotonic() - self.t0, float("nan"), 0.0, where]
        try:
            return run()
        finally:
            self.times[name][1] = time.monotonic() - self.t0

    def report(self) -> list[str]:
        """One line a job, in the order they started: when it ran and how long the tests reading it waited."""
        return [f"{name:28s} {where:10s} {start:7.1f} s -> {end:7.1f} s ({end - start:5.1f} s), waited {waited:5.1f} s"
                for name, (start, end, waited, where) in sorted(self.times.items(), key=lambda kv: kv[1][0])]

    def close(self) -> None:
        """Drop the jobs no test asked for after all (a run stopped early) and wait for the ones running."""
        self._pool.shutdown(wait=True, cancel_futures=True)
