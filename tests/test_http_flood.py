"""One engine server (a real subprocess, started with the open-file limit most Linux systems give a process,
1,024) under 12,288 idle connections (fewer where this machine lets one process open fewer), three times
the server's connection cap (its default, 4,096, unless the limit here is too low for three times it):
each sends half a request line and waits. A keyed client's /generate still answers, during the flood and
after it, and the server's log stays small."""
import asyncio
import contextlib
import re
import resource
import socket
import time
from collections import Counter

import aiohttp
import pytest

from april_ray.engine.sglang_server import CPUServerLauncher, ServerOptions

pytestmark = pytest.mark.slow

TARGET = 3 * 4096
"""Idle connections to open, if the hard limit on open files lets this process hold them."""


@contextlib.contextmanager
def soft_nofile(limit: int):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(limit, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def keyed_generate(srv) -> tuple:
    """(status of /generate or its error, its tokens, status of /health, seconds, seconds of them spent
    connecting), on fresh connections."""
    t0 = time.perf_counter()
    status, tokens, health, connecting = None, 0, None, []
    trace = aiohttp.TraceConfig()

    async def started(session, context, params):
        context.t = time.perf_counter()

    async def ended(session, context, params):
        connecting.append(time.perf_counter() - context.t)
    trace.on_connection_create_start.append(started)
    trace.on_connection_create_end.append(ended)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60), trace_configs=[trace]) as s:
            body = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
            auth = {"Authorization": f"Bearer {srv.api_key}"}
            async with s.post(srv.url + "/generate", json=body, headers=auth) as r:
                status, tokens = r.status, len((await r.json())["output_ids"]) if r.status == 200 else 0
            async with s.get(srv.url + "/health") as r:
                health = r.status
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        status = status or repr(e)
    return status, tokens, health, round(time.perf_counter() - t0, 2), round(sum(connecting), 2)


async def flood(srv, n: int) -> dict:
    host, port = srv.url.rsplit("/", 1)[-1].rsplit(":", 1)
    loop = asyncio.get_running_loop()
    socks: list[socket.socket] = []
    outcome: Counter = Counter()
    gate = asyncio.Semaphore(1024)

    async def idle_connection() -> None:
        async with gate:
            s = socket.socket()
            s.setblocking(False)
            socks.append(s)
            try:
                await asyncio.wait_for(loop.sock_connect(s, (host, int(port))), 5)
                outcome["connected"] += 1
                s.send(b"POST /generate HTT")  # half a request line, and nothing more
            except (OSError, asyncio.TimeoutError) as e:
                outcome[type(e).__name__] += 1

    try:
        await asyncio.gather(*[idle_connection() for _ in range(n // 2)])
        during = asyncio.ensure_future(keyed_generate(srv))
        await asyncio.gather(*[idle_connection() for _ in range(n - n // 2)])
        result = {"during": await during, "after": await keyed_generate(srv)}
        result["metrics"] = ""
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                async with s.get(srv.url + "/metrics") as r:
                    result["metrics"] = await r.text() if r.status == 200 else ""
        return {**result, "outcome": outcome}
    finally:
        for s in socks:
            s.close()


def test_idle_connections_far_above_the_cap_do_not_starve_a_keyed_client(random_model_dir, tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    n = min(TARGET, (hard if hard != resource.RLIM_INFINITY else TARGET + 500) - 300)
    opts = ServerOptions(str(random_model_dir), max_num_seqs=8, max_model_len=640, startup_timeout_s=120,
                         log_dir=str(tmp_path), extra_args=["--max-connections", str(min(4096, n // 3))])
    with soft_nofile(1024):
        srv = CPUServerLauncher().start(opts)
    try:
        with soft_nofile(n + 300):
            out = asyncio.run(flood(srv, n))
        log = srv.log_path.read_text(errors="replace")
    finally:
        srv.stop()
    cap = re.search(r"at most (\d+) connections", log)
    samples = dict(line.rsplit(" ", 1) for line in out["metrics"].splitlines() if not line.startswith("#"))
    evicted = float(samples.get('april_engine_connections_closed_total{reason="evicted"}', 0))
    print(f"\nidle connections attempted {n} (hard limit {hard}), {dict(out['outcome'])}; server cap "
          f"{cap and cap.group(1)}, evicted {evicted:.0f}; keyed /generate during the flood {out['during']}, after "
          f"{out['after']}; server log {len(log.encode())} bytes, {log.count(chr(10))} lines, its last ones:\n"
          + "\n".join(log.splitlines()[-4:])[-2000:])
    assert cap is not None, log[-2000:]
    cap = int(cap.group(1))
    assert out["outcome"]["connected"] > cap and evicted > 0
    for status, tokens, health, *_ in (out["during"], out["after"]):
        assert status == 200 and tokens == 4 and health == 200
    assert len(log.encode()) < 1 << 20 and "out of system resource" not in log
