"""Virtual time for asyncio, and the CPU each part of a simulation really spends.

`VirtualLoop` is asyncio's own selector loop, through its public API only: `time()` reads a virtual
clock, and its selector never waits: when nothing is ready, `select(timeout)` moves the clock to the next
timer instead of sleeping. So `asyncio.sleep`, `call_at` and `asyncio.wait(..., timeout=)` all run in
virtual time, the completion monitor's `clock` argument is `loop.time`, and a simulated hour takes only
as long as its callbacks' CPU.

Accounting: every callback scheduled through `call_soon` or `call_at` belongs to an owner (the task whose
step or wake-up it is, or the object whose method it is). `watch(owner, account)` (or `spawn(coro,
account)` for a new task, its first step included) times that owner's callbacks with `time.process_time`
and adds them to `cpu[account]`; callbacks of unwatched owners go to `default_account` (untimed when it
is None). An account in `clocked` also spends its CPU on the virtual clock: the monitor's own work takes
time, as it does on its host core, and completions that arrive meanwhile reach it together. With `stall`
set, that time also holds up the simulated engines (`stall_s`): everything then shares one thread, as the
in-process benchmark's engine and control plane do.
"""
from __future__ import annotations

import asyncio
import gc
import selectors
import threading
import time
from collections import defaultdict


class SimulationStalled(RuntimeError):
    """Nothing is ready and no timer is set: every task waits for something that will never happen."""


class _VirtualSelector(selectors.SelectSelector):
    """Moves the clock instead of sleeping. While a thread started since the loop was made is alive (a
    result may come back through `call_soon_threadsafe`), it waits for real, up to THREAD_WAIT_S, before
    moving the clock on (only then: with callbacks ready it just polls). Threads that were already alive
    when the loop was made (a notebook's kernel threads, a progress bar's monitor) are not the
    simulation's and hold nothing up, but for work the loop hands to one (`run_in_executor`: its calls in
    flight are counted). With no thread of its own it makes no system call at all."""

    THREAD_WAIT_S = 5.0

    def __init__(self, loop: "VirtualLoop"):
        super().__init__()
        self.loop = loop

    def select(self, timeout=None):
        threads = self.loop.threads_of_its_own()  # alone, nothing can write to the loop's pipes
        if timeout is not None and timeout <= 0:
            return super().select(0) if threads else []
        waited = 0.0
        while threads and waited < self.THREAD_WAIT_S:
            events = super().select(0.01)
            if events:
                return events
            waited += 0.01
            threads = self.loop.threads_of_its_own()
        if timeout is None:
            raise SimulationStalled("virtual clock: no callback is ready and no timer is set")
        self.loop.now += timeout
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self):
        self.now = 0.0
        self.cpu: dict[str, float] = defaultdict(float)
        """CPU seconds (process time) per account."""
        self.owners: dict[int, tuple[object, str]] = {}
        self.default_account: str | None = None
        self.clocked: set[str] = set()
        self.stall = False
        self._spawning: str | None = None
        self.stall_s = 0.0
        """Virtual seconds the simulated engines have been held up by clocked work (with `stall`)."""
        self.foreign_threads = frozenset(threading.enumerate())
        """The threads alive when the loop was made, its own included: not the simulation's."""
        self.executor_calls = 0
        """`run_in_executor` calls whose result has not reached the loop yet."""
        super().__init__(_VirtualSelector(self))

    def time(self) -> float:
        return self.now

    def threads_of_its_own(self) -> bool:
        """Whether a result may come from another thread: a thread started since the loop was made is
        alive or starting, or an executor call is in flight (its thread may be older than the loop)."""
        if threading.active_count() <= 1:
            return False
        if self.executor_calls:
            return True
        foreign = self.foreign_threads
        return any(t not in foreign for t in threading.enumerate())

    def run_in_executor(self, executor, func, *args):
        fut = super().run_in_executor(executor, func, *args)
        self.executor_calls += 1
        fut.add_done_callback(self._executor_call_done)
        return fut

    def _executor_call_done(self, _) -> None:
        self.executor_calls -= 1

    def watch(self, owner, account: str) -> None:
        """Time `owner`'s callbacks into `cpu[account]` (a task is forgotten when it is done)."""
        self.owners[id(owner)] = (owner, account)
        if isinstance(owner, asyncio.Future):
            owner.add_done_callback(lambda f: self.owners.pop(id(f), None))

    def spawn(self, coro, account: str) -> asyncio.Task:
        """A task whose every step, its first included, is timed into `account`."""
        self._spawning = account
        try:
            return self.create_task(coro)
        finally:
            self._spawning = None

    def _account(self, callback) -> str | None:
        """The account of a callback: its `__self__`'s (a task's step, a method), else the default."""
        owner = getattr(callback, "__self__", None)  # none: a function or a partial (a future's callback)
        if owner is None:
            return self.default_account
        if self._spawning is not None and isinstance(owner, asyncio.Task):
            self.watch(owner, self._spawning)
        entry = self.owners.get(id(owner))
        return entry[1] if entry is not None and entry[0] is owner else self.default_account

    def call_soon(self, callback, *args, context=None):
        account = self._account(callback)
        if account is None:
            return super().call_soon(callback, *args, context=context)
        return super().call_soon(self._timed, account, callback, *args, context=context)

    def call_at(self, when, callback, *args, context=None):
        account = self._account(callback)
        if account is None:
            return super().call_at(when, callback, *args, context=context)
        return super().call_at(when, self._timed, account, callback, *args, context=context)

    def _timed(self, account: str, callback, *args) -> None:
        t0 = time.process_time()
        try:
            callback(*args)
        finally:
            dt = time.process_time() - t0
            self.cpu[account] += dt
            if account in self.clocked:
                self.now += dt
                if self.stall:
                    self.stall_s += dt


def run_virtual(main, loop: VirtualLoop | None = None):
    """Run coroutine function `main(loop)` to completion on a (new) virtual loop; returns its result.

    The cyclic garbage collector is off meanwhile, and collects once at the end: a simulation keeps every
    engine's requests and every sample in one process, and the collector's passes over that heap would
    land on whichever callback allocates (the monitor's, mostly), billing the simulation's own garbage to
    the control plane, whose real process holds only metadata."""
    loop = loop or VirtualLoop()
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with asyncio.Runner(loop_factory=lambda: loop) as runner:
            return runner.run(main(loop))
    finally:
        if enabled:
            gc.enable()
        gc.collect()
