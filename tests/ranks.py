"""Run a function as several torch.distributed ranks in spawned processes (the learner's multi-rank tests)."""
import socket

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target, world: int, *args, timeout_s: float = 240) -> dict:
    """`target(rank, world, port, *args, out)` in `world` spawned processes; returns `out`, the dict each
    rank writes its results into. Fails if a rank exits non-zero or hangs past `timeout_s`."""
    port = free_port()
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        procs = [ctx.Process(target=target, args=(r, world, port, *args, out)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        for p in procs:
            if p.is_alive():
                p.kill()
        assert [p.exitcode for p in procs] == [0] * world, "a rank failed or hung"
        return dict(out)
