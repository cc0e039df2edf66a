"""The connections of our engine server (`http_server.serve`), held under idle, slow and flooding clients.

As OpenSSH's MaxStartups treats unauthenticated sessions: a connection is *pending* until a request on it
passes the key check, then *admitted*. All share one cap (`max_connections`, kept below the process's
file-descriptor limit); a connection arriving at the cap closes the oldest pending one to take its place,
and is itself refused (closed at once) only when every connection is admitted. So clients without a key
can fill the pending slots but cannot starve a keyed client, whose fresh connection takes an idle one's
place and is admitted by its first request. A pending connection with no request in progress is closed
after `header_timeout_s` (a half-sent request line, a client that never sends one); an admitted one that
stays idle is closed by aiohttp's keep-alive timeout. What was closed or refused is counted and logged at
most once per `log_every_s`, and so is an accept that failed for lack of file descriptors (asyncio's own
loop logs each of those, several times per attempt).
"""
from __future__ import annotations

import asyncio
import errno
import os
import resource
import socket
import time
from collections import Counter

RESERVED_FDS = 256
"""File descriptors kept for everything but client connections: model files, threads, gloo sockets, logs."""

OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

REASONS = {"evicted": "pending connections closed to make room for new ones",
           "refused": "connections refused at the cap (every open one admitted)",
           "header_timeout": "pending connections closed with no request for the header timeout",
           "body_timeout": "requests whose body did not arrive within the body timeout",
           "accept_failed": "accepts that failed for lack of file descriptors"}


ACCEPTS_PER_TICK = 128
"""Connections asyncio accepts per loop iteration (its `backlog`): few, so a flood of new connections holds
up the requests already being served only briefly."""


def deepen_accept_queue(server: asyncio.Server, depth: int = 65535) -> None:
    """Let the kernel queue up to `depth` connections not yet accepted (capped at net.core.somaxconn), as
    Go's listeners do: under a flood a client's connection waits its turn instead of having its SYN dropped
    and retried a second or more later. asyncio passes `listen` the same number as its accepts per
    iteration, hence a second `listen` on the same socket."""
    for sock in server.sockets:
        with socket.socket(fileno=os.dup(sock.fileno())) as same:
            same.listen(depth)


def raise_fd_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit, as servers do at start (Go's runtime
    does it for every program); returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


class _Conn:
    __slots__ = ("transport", "since", "busy")

    def __init__(self, transport: asyncio.Transport, since: float):
        self.transport, self.since, self.busy = transport, since, 0


class ConnectionGuard:
    def __init__(self, max_connections: int, header_timeout_s: float, log_every_s: float = 10.0):
        self.max_connections = max(1, max_connections)
        self.header_timeout_s, self.log_every_s = header_timeout_s, log_every_s
        self.pending: dict[asyncio.BaseTransport, _Conn] = {}
        """Oldest first (dicts keep insertion order): the first is the one a new connection replaces."""
        self.admitted: dict[asyncio.BaseTransport, _Conn] = {}
        self.totals: Counter = Counter()
        self._logged: Counter = Counter()
        self._last_log = time.monotonic()
        self._sweeper: asyncio.Task | None = None

    @property
    def open(self) -> int:
        return len(self.pending) + len(self.admitted)

    def protocol_factory(self, make_protocol):
        """Wrap an aiohttp protocol factory (`AppRunner.server`) for `loop.create_server`."""
        return lambda: _Guarded(make_protocol(), self)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Sweep timed-out connections and log the counts from now on; take over the loop's report of an
        accept that ran out of file descriptors."""
        self._sweeper = loop.create_task(self._sweep_forever())
        previous = loop.get_exception_handler()

        def handler(loop, context):
            exc = context.get("exception")
            if isinstance(exc, OSError) and exc.errno in OUT_OF_FDS and "accept" in context.get("message", ""):
                self.accept_failed()
            elif previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)
        loop.set_exception_handler(handler)

    # -- the connection's life ------------------------------------------------------------------------
    def opened(self, transport: asyncio.BaseTransport) -> bool:
        if self.open >= self.max_connections:
            if not self.pending:
                self._count("refused")
                transport.abort()
                return False
            self._close(next(iter(self.pending.values())), "evicted")
        self.pending[transport] = _Conn(transport, time.monotonic())
        return True

    def closed(self, transport: asyncio.BaseTransport) -> None:
        if self.pending.pop(transport, None) is None:
            self.admitted.pop(transport, None)

    def request_started(self, transport: asyncio.BaseTransport | None) -> None:
        conn = self._find(transport)
        if conn is not None:
            conn.busy += 1

    def request_ended(self, transport: asyncio.BaseTransport | None) -> None:
        conn = self._find(transport)
        if conn is not None:
            conn.busy -= 1
            conn.since = time.monotonic()

    def admit(self, transport: asyncio.BaseTransport | None) -> None:
        """A request on this connection passed the key check: it is no longer a candidate for eviction."""
        conn = self.pending.pop(transport, None)
        if conn is not None:
            self.admitted[transport] = conn

    def body_timed_out(self) -> None:
        self._count("body_timeout")

    def accept_failed(self) -> None:
        """Out of file descriptors at accept (something besides our connections holds them): the oldest
        pending connections make room for asyncio's next try (a second later)."""
        self._count("accept_failed")
        for conn in list(self.pending.values())[:16]:
            self._close(conn, "evicted")

    # -- internals ------------------------------------------------------------------------------------
    def _find(self, transport) -> _Conn | None:
        return self.pending.get(transport) or self.admitted.get(transport)

    def _close(self, conn: _Conn, reason: str) -> None:
        self.closed(conn.transport)
        conn.transport.abort()
        self._count(reason)

    def _count(self, reason: str) -> None:
        self.totals[reason] += 1
        self._logged[reason] += 1

    def sweep(self, now: float) -> None:
        """Close pending connections idle past the header timeout; log the counts once an interval is over."""
        for conn in [c for c in self.pending.values() if not c.busy and now - c.since > self.header_timeout_s]:
            self._close(conn, "header_timeout")
        if self._logged and now - self._last_log >= self.log_every_s:
            print(self.summary(now - self._last_log), flush=True)
            self._logged.clear()
            self._last_log = now

    def summary(self, seconds: float) -> str:
        counts = ", ".join(f"{n} {REASONS[r]}" for r, n in self._logged.items())
        return (f"connections: {self.open} open ({len(self.pending)} without a key yet, cap {self.max_connections}); "
                f"in the last {seconds:.0f}s: {counts}")

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.header_timeout_s / 4))
            self.sweep(time.monotonic())


HEAD_END = b"\r\n\r\n"
MAX_HEAD = 64 << 10
"""Bytes of a request head held back at most (aiohttp refuses far smaller heads: 8 KiB a line)."""


class _Guarded(asyncio.Protocol):
    """aiohttp's protocol for one connection, registered with the guard first and started only once the
    first request's head has arrived whole, as FreeBSD's `accf_http` accept filter holds a connection
    back: a client that sends half a request line costs a buffer, not a handler and its task."""

    def __init__(self, inner: asyncio.Protocol, guard: ConnectionGuard):
        self.inner: asyncio.Protocol | None = inner
        self.guard = guard
        self.transport: asyncio.BaseTransport | None = None
        self.head: bytearray | None = bytearray()
        """What came before the first request's head was whole (None once aiohttp has the connection)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        if not self.guard.opened(transport):
            self.inner = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.closed(self.transport)
        if self.inner is not None and self.head is None:
            self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.inner is None:
            return
        if self.head is None:
            self.inner.data_received(data)
            return
        start = max(0, len(self.head) - 3)
        self.head += data
        if self.head.find(HEAD_END, start) >= 0 or len(self.head) > MAX_HEAD:
            head, self.head = bytes(self.head), None
            self.inner.connection_made(self.transport)
            self.inner.data_received(head)

    def eof_received(self) -> bool | None:
        if self.inner is None or self.head is not None:
            return None  # (the transport closes)
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        if self.inner is not None and self.head is None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None and self.head is None:
            self.inner.resume_writing()
