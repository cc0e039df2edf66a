"""Virtual time for asyncio, and the CPU each part of a simulation really spends.

`VirtualLoop` is asyncio's own selector loop with a selector that never waits: when nothing is ready,
`select(timeout)` moves the clock to the next timer instead of sleeping. So `asyncio.sleep`, `call_at`
and `asyncio.wait(..., timeout=)` all run in virtual time, the completion monitor's `clock` argument is
`loop.time`, and a simulated hour takes only as long as its callbacks' CPU.

Accounting: every callback the loop runs belongs to an owner (the task whose step or wake-up it is, or
the object whose method it is). `watch(owner, account)` (or `spawn(coro, account)` for a new task, its
first step included) times that owner's callbacks with
`time.process_time` and adds them to `cpu[account]`; callbacks of unwatched owners go to
`default_account` (untimed when it is None). An account in `clocked` also spends its CPU on the virtual
clock: the monitor's own work takes time, as it does on its host core, and completions that arrive
meanwhile reach it together. With `stall` set, that time also holds up the simulated engines
(`stall_s`): everything then shares one thread, as the in-process benchmark's engine and control plane do.
"""
from __future__ import annotations

import asyncio
import gc
import heapq
import itertools
import selectors
import threading
import time
from collections import defaultdict


class SimulationStalled(RuntimeError):
    """Nothing is ready and no timer is set: every task waits for something that will never happen."""


def _alive_threads() -> list[threading.Thread]:
    """The threads alive or starting, without `threading.enumerate`'s lock: its two registries, read as
    they are (a copy of a dict's values is atomic), the starting ones first (a thread moves from `_limbo`
    to `_active`: read the other way round, one moving in between would be in neither)."""
    return [*threading._limbo, *threading._active.values()]


class _Timer:
    """A timer for a callback that takes no arguments and needs no context (a simulated engine's span
    end: one per event of a large simulation). It sits in the loop's heap and ready queue as an
    asyncio `TimerHandle` would, without the handle's context copy and debug hooks; an exception in its
    callback ends the simulation (a handle's would only be logged)."""

    __slots__ = ("_callback", "_cancelled", "_scheduled")

    def __init__(self, callback):
        self._callback, self._cancelled, self._scheduled = callback, False, True

    def cancel(self) -> None:
        self._cancelled = True

    def cancelled(self) -> bool:
        return self._cancelled

    def _run(self) -> None:
        self._callback()


class _VirtualSelector(selectors.SelectSelector):
    """Never sleeps in virtual time; but while a thread started since the loop was made is alive (a
    result may come back through `call_soon_threadsafe`), it waits for real, up to THREAD_WAIT_S, before
    moving the clock on (only then: with callbacks ready it just polls). Threads that were already alive
    when the loop was made (a notebook's kernel threads, a progress bar's monitor) are not the
    simulation's and hold nothing up, but for work the loop hands to one (`run_in_executor` on an
    executor made before the loop: its calls in flight are counted). With no thread of its own it makes
    no system call at all (one
    `select` per loop iteration was ~9% of a large simulation's CPU); `VirtualLoop._run_once` then does not
    call it either."""

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
        self._timers: list[tuple[float, int, asyncio.TimerHandle | _Timer]] = []
        self._timer_seq = itertools.count()
        self.foreign_threads = frozenset(_alive_threads())
        """The threads alive when the loop was made, its own included: not the simulation's."""
        self.executor_calls = 0
        """`run_in_executor` calls whose result has not reached the loop yet."""
        super().__init__(_VirtualSelector(self))

    def time(self) -> float:
        return self.now

    def threads_of_its_own(self) -> bool:
        """Whether a result may come from another thread: a thread started since the loop was made is
        alive or starting, or an executor call is in flight (its thread may be older than the loop).
        Counted first (a check per loop iteration; the threads are compared only when there are more than
        the loop's own, so one that ended and one that started cannot cancel out)."""
        if len(threading._limbo) + len(threading._active) <= 1:
            return False
        if self.executor_calls:
            return True
        foreign = self.foreign_threads
        return any(t not in foreign for t in _alive_threads())

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

    def _account(self, owner) -> str | None:
        """The account of a callback whose `__self__` is `owner` (a task's step, a method)."""
        if self._spawning is not None and isinstance(owner, asyncio.Task):
            self.watch(owner, self._spawning)
        entry = self.owners.get(id(owner))
        return entry[1] if entry is not None and entry[0] is owner else self.default_account

    def call_soon(self, callback, *args, context=None):
        owner = getattr(callback, "__self__", None)  # none: a function or a partial (a future's callback)
        account = self.default_account if owner is None else self._account(owner)
        if account is not None:
            args, callback = (account, callback, *args), self._timed
        if self._closed:
            raise RuntimeError("Event loop is closed")
        handle = asyncio.Handle(callback, args, self, context)  # `BaseEventLoop.call_soon`, two calls shorter
        self._ready.append(handle)
        return handle

    def call_at(self, when, callback, *args, context=None):
        owner = getattr(callback, "__self__", None)
        account = self.default_account if owner is None else self._account(owner)
        if account is not None:
            args, callback = (account, callback, *args), self._timed
        self._check_closed()
        timer = asyncio.TimerHandle(when, callback, args, self, context)
        heapq.heappush(self._timers, (when, next(self._timer_seq), timer))
        timer._scheduled = True
        return timer

    def timer(self, when: float, callback):
        """`call_at(when, callback)` for a bound method that takes no arguments and needs no context: a bare
        `_Timer`, unless its owner's callbacks are timed into an account (then `call_at`'s handle)."""
        owner = callback.__self__
        entry = self.owners.get(id(owner))
        if (entry[1] if entry is not None and entry[0] is owner else self.default_account) is not None:
            return self.call_at(when, callback)
        timer = _Timer(callback)
        heapq.heappush(self._timers, (when, next(self._timer_seq), timer))
        return timer

    def _timer_handle_cancelled(self, handle) -> None:
        """A cancelled timer stays in the heap until it reaches the top, and is dropped there."""

    def _run_once(self) -> None:
        """asyncio's loop iteration (`BaseEventLoop._run_once`) over a heap of (when, seq, handle) tuples:
        their comparisons stay in C, where `TimerHandle.__lt__` is a Python call per comparison (a tenth
        of a large simulation's CPU went to the timer heap)."""
        timers, ready = self._timers, self._ready
        while timers and timers[0][2]._cancelled:
            heapq.heappop(timers)[2]._scheduled = False
        if ready or self._stopping:
            timeout = 0
        else:
            timeout = max(0.0, timers[0][0] - self.now) if timers else None
        if len(threading._limbo) + len(threading._active) > 1 and self.threads_of_its_own():  # (the count
            # inline) a result may come through the self-pipe: the selector waits for it
            self._process_events(self._selector.select(timeout))
        elif timeout is None:
            raise SimulationStalled("virtual clock: no callback is ready and no timer is set")
        else:  # alone: nothing can arrive, the selector would only move the clock (`_VirtualSelector`)
            self.now += timeout
        end = self.now + self._clock_resolution
        while timers and timers[0][0] < end:
            handle = heapq.heappop(timers)[2]
            handle._scheduled = False
            ready.append(handle)
        for _ in range(len(ready)):
            handle = ready.popleft()
            if not handle._cancelled:
                handle._run()

    def close(self) -> None:
        self._timers.clear()
        super().close()

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

    The cyclic garbage collector is off meanwhile, and collects once at the end. A simulation keeps every
    engine's requests and every sample in one process; the collector's passes over that heap land on
    whichever callback allocates (the monitor's, mostly), billing the simulation's own garbage to the
    control plane, whose real process holds only metadata. Reference counting frees almost everything
    anyway: at 256 GPUs the passes were a fifth of the CPU (even at one young pass per 200,000
    allocations), and at 1,024 GPUs x 9 steps the peak memory stayed under 1 GB without them."""
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

