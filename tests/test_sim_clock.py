"""The simulator's virtual clock (sim/clock.py): asyncio in virtual time through its public API, the CPU
each account spends, and threads: only those of the simulation's own hold the clock up."""
import asyncio
import time

import pytest

from sim.clock import SimulationStalled, run_virtual


def real_waits(monkeypatch) -> list:
    """The timeouts the virtual loop passes to the real `select` (a wait for real, when positive)."""
    import selectors

    timeouts, select = [], selectors.SelectSelector.select

    def recording(self, timeout=None):
        timeouts.append(timeout)
        return select(self, timeout)

    monkeypatch.setattr(selectors.SelectSelector, "select", recording)
    return timeouts


def test_virtual_clock_jumps_instead_of_sleeping(monkeypatch):
    async def main(loop):
        t0 = loop.time()
        await asyncio.sleep(60.0)
        done, _ = await asyncio.wait([asyncio.ensure_future(asyncio.sleep(5.0))], timeout=30.0)
        return loop.time() - t0, len(done)

    waits = real_waits(monkeypatch)
    elapsed, done = run_virtual(main)
    assert elapsed == pytest.approx(65.0) and done == 1
    assert all(t is not None and t <= 0.01 for t in waits)  # never a wait for the timers' time


def test_virtual_clock_reports_a_deadlock_instead_of_hanging():
    async def main(loop):
        await loop.create_future()

    with pytest.raises(SimulationStalled):
        run_virtual(main)


def test_watched_cpu_is_charged_to_its_account_and_to_the_clock():
    async def busy():
        t = time.process_time()
        while time.process_time() - t < 0.02:
            pass

    async def main(loop):
        loop.clocked.add("cp")
        await loop.spawn(busy(), "cp")
        return loop.time(), loop.cpu["cp"]

    now, cpu = run_virtual(main)
    assert cpu >= 0.02 and now == pytest.approx(cpu)


def test_a_thread_of_its_own_delays_only_the_clock_jumps(monkeypatch):
    """While a thread started during the simulation lives (it could post a result), the loop waits for
    real before jumping the clock, but not on the iterations that have callbacks ready: 1,000 of those
    cost no waiting."""
    import threading

    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, daemon=True)

    async def main(loop):
        thread.start()
        for _ in range(1000):
            await asyncio.sleep(0)
        return loop.time()

    waits = real_waits(monkeypatch)
    try:
        assert run_virtual(main) == 0.0
        assert len(waits) >= 1000 and all(t == 0 for t in waits)  # every ready iteration polls, none waits
    finally:
        stop.set()
        thread.join()


def test_a_result_posted_by_a_thread_of_its_own_arrives_before_the_clock_jumps():
    """A thread started during the simulation posts its result after a real delay, while the next timer
    is an hour away: the loop waits for it rather than jumping the clock (the result arrives at virtual
    time 0, and before the timer)."""
    import threading
    import time

    async def main(loop):
        fut = loop.create_future()
        timer = asyncio.ensure_future(asyncio.sleep(3600.0))
        threading.Thread(target=lambda: (time.sleep(0.2), loop.call_soon_threadsafe(fut.set_result, loop.time())),
                         daemon=True).start()
        posted_at = await fut
        return posted_at, loop.time(), timer.done()

    assert run_virtual(main) == (0.0, 0.0, False)


def test_an_executor_call_on_a_thread_older_than_the_loop_is_waited_for():
    """Work handed by `run_in_executor` to a pool whose thread was alive before the loop was made: the
    loop waits for its result rather than jumping the clock to the next timer."""
    import concurrent.futures
    import time

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: None).result()  # its one thread starts now, before the loop

        async def main(loop):
            timer = asyncio.ensure_future(asyncio.sleep(3600.0))
            await loop.run_in_executor(pool, time.sleep, 0.2)
            return loop.time(), timer.done(), loop.executor_calls

        assert run_virtual(main) == (0.0, False, 0)


def test_threads_alive_before_the_loop_hold_nothing_up(monkeypatch):
    """Threads that were alive when the loop was made (a notebook kernel's, a progress bar's monitor) are
    not the simulation's: a day of virtual sleeps makes no real wait and no system call to wait in."""
    import threading

    stop = threading.Event()
    threads = [threading.Thread(target=stop.wait, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()

    async def main(loop):
        for _ in range(24):
            await asyncio.sleep(3600.0)
        return loop.time()

    waits = real_waits(monkeypatch)
    try:
        assert run_virtual(main) == 24 * 3600.0
        assert waits == []
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_the_virtual_loop_overrides_only_public_methods_of_asyncios_loop():
    """Virtual time through asyncio's public API: no private method of the selector loop or of the
    selector is replaced (`_abc_impl` is the ABC machinery's own, set on every subclass)."""
    import selectors

    from sim.clock import VirtualLoop, _VirtualSelector

    for ours, base in ((VirtualLoop, asyncio.SelectorEventLoop), (_VirtualSelector, selectors.SelectSelector)):
        replaced = [n for n in vars(ours) if n.startswith("_") and not n.startswith("__") and n != "_abc_impl"
                    and hasattr(base, n)]
        assert replaced == [], (ours, replaced)
