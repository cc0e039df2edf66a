"""The engine server's connection guard (`engine/connections.py`) on its own: who gives way at the cap, what
times out, and how much it logs when accept runs out of file descriptors (the real server under a flood:
`test_http_flood.py`)."""
import asyncio
import errno
import time

from april_ray.engine.connections import ConnectionGuard


class Transport:
    def __init__(self, name):
        self.name, self.aborted = name, False

    def abort(self):
        self.aborted = True


def test_at_the_cap_the_oldest_without_a_key_gives_way_and_keyed_ones_never_do():
    guard = ConnectionGuard(max_connections=3, header_timeout_s=10)
    keyed, a, b = Transport("keyed"), Transport("a"), Transport("b")
    for t in (keyed, a, b):
        assert guard.opened(t)
    guard.admit(keyed)
    c = Transport("c")
    assert guard.opened(c) and a.aborted and not keyed.aborted  # the oldest pending one made room
    guard.admit(b)
    guard.admit(c)
    late = Transport("late")
    assert not guard.opened(late) and late.aborted  # every open one is admitted: the new one is refused
    assert guard.totals == {"evicted": 1, "refused": 1} and guard.open == 3
    guard.closed(b)
    assert guard.opened(Transport("d")) and guard.open == 3


def test_a_pending_connection_idle_past_the_header_timeout_is_closed_a_busy_or_keyed_one_is_not():
    guard = ConnectionGuard(max_connections=10, header_timeout_s=5)
    idle, busy, keyed = Transport("idle"), Transport("busy"), Transport("keyed")
    for t in (idle, busy, keyed):
        guard.opened(t)
    guard.request_started(busy)
    guard.admit(keyed)
    guard.sweep(time.monotonic() + 6)
    assert idle.aborted and not busy.aborted and not keyed.aborted
    guard.request_ended(busy)  # its clock starts again at the end of its request
    guard.sweep(time.monotonic() + 1)
    assert not busy.aborted
    guard.sweep(time.monotonic() + 6)
    assert busy.aborted and not keyed.aborted and guard.totals["header_timeout"] == 2


def test_accepts_out_of_file_descriptors_are_counted_and_logged_once_per_interval(capsys):
    """asyncio's loop reports each failed accept (several per attempt, with a traceback each); the guard
    counts them, makes room by closing pending connections, and leaves other reports to the old handler."""
    seen = []

    async def main():
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda loop, context: seen.append(context["message"]))
        guard = ConnectionGuard(max_connections=100, header_timeout_s=10, log_every_s=10)
        guard.start(loop)
        pending = [Transport(i) for i in range(20)]
        for t in pending:
            guard.opened(t)
        for _ in range(10_000):
            loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                         "exception": OSError(errno.EMFILE, "Too many open files")})
        loop.call_exception_handler({"message": "something else", "exception": RuntimeError("x")})
        for dt in (1, 5, 11, 12):
            guard.sweep(time.monotonic() + dt)
        guard._sweeper.cancel()
        return guard, pending
    guard, pending = asyncio.run(main())
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "10000 accepts that failed for lack of file descriptors" in lines[0], lines
    assert seen == ["something else"] and all(t.aborted for t in pending) and guard.open == 0
