"""Run a function as several torch.distributed ranks in spawned processes (the learner's multi-rank tests)."""
import socket

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(target, rank: int, world: int, port: int, *args) -> None:
    """`target` in a spawned rank, then its process group torn down before the process exits: gloo's
    threads still running at exit can abort a rank that did its work ("terminate called without an active
    exception", exit code -6, seen once in CI)."""
    try:
        target(rank, world, port, *args)
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(target, world: int, *args, timeout_s: float = 240) -> dict:
    """`target(rank, world, port, *args, out)` in `world` spawned processes; returns `out`, the dict each
    rank writes its results into. Fails if a rank exits non-zero or hangs past `timeout_s`."""
    port = free_port()
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        out = manager.dict()
        procs = [ctx.Process(target=_rank_main, args=(target, r, world, port, *args, out)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout_s)
        for p in procs:
            if p.is_alive():
                p.kill()
        assert [p.exitcode for p in procs] == [0] * world, "a rank failed or hung"
        return dict(out)
