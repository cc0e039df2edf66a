"""Jobs that session fixtures share, started ahead of the tests that read them. A job's phases are mostly one
process at a time (the driver's imports, Ray's start, each actor's imports), so on two cores a job leaves
about a core idle: the suite's other tests use it meanwhile. The jobs run one after another in one thread, in
the order the collected tests first ask for them; a fixture asked for before its job started runs it itself.
Only the jobs some collected test asks for are run (`pytest tests/test_config.py` starts none)."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable


def wanted(item) -> set[str]:
    """The fixtures `item` asks for, by name: its arguments', and a parameter naming one (getfixturevalue)."""
    callspec = getattr(item, "callspec", None)
    params = callspec.params.values() if callspec is not None else ()
    return set(item.fixturenames) | {p for p in params if isinstance(p, str)}


def first_asked(names, items) -> list[str]:
    """The `names` that `items` (the collected tests, in run order) ask for, first asked first."""
    first = {}
    for i, item in enumerate(items):
        if item.get_closest_marker("skip") is None:
            for name in wanted(item) & set(names):
                first.setdefault(name, i)
    return sorted(first, key=first.get)


class Prefetch:
    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self._futures: dict[str, Future] = {}

    def submit(self, name: str, run: Callable[[], object]) -> None:
        self._futures[name] = self._pool.submit(run)

    def result(self, name: str, run: Callable[[], object]):
        """The job's result, waited for; `run()` here when it was never queued or had not started yet."""
        future = self._futures.pop(name, None)
        if future is None or future.cancel():
            return run()
        return future.result()

    def close(self) -> None:
        """Drop the jobs no test asked for after all (a run stopped early) and wait for the one running."""
        self._pool.shutdown(wait=True, cancel_futures=True)
