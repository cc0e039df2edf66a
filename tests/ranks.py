"""Run a function as several torch.distributed ranks in processes of their own (the learner's multi-rank tests).

The ranks are a pool of worker processes started once per session: a process pays torch's and DeepSpeed's
imports (about 7 CPU-seconds) once, not once per test. Each call is a fresh process group on a new port,
torn down after, in a process that is then as a fresh one would be: the environment, working directory and
`sys.path` are the caller's at the call (what a process spawned then would get), and torch's default dtype,
thread count, RNG state and grad mode are the worker's at its start. A worker whose torch.distributed or
DeepSpeed state does not come back clean retires, and so does the whole pool when a rank fails or hangs: the
next call starts fresh processes."""
import atexit
import os
import pickle
import socket
import sys
import time
import traceback
import warnings

import torch.multiprocessing as mp
from multiprocessing.connection import wait


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Fresh:
    """What a target may change process-wide, as the worker had it at its start."""

    def __init__(self):
        import torch
        import torch.nn.functional as F

        self.dtype, self.threads = torch.get_default_dtype(), torch.get_num_threads()
        self.rng = torch.get_rng_state()
        self.linear, self.tensor_new = F.linear, torch.Tensor.__new__
        self.module_hooks = torch.nn.Module.apply, torch.nn.Module.__dict__.get("__init_subclass__")

    @staticmethod
    def arrive(env: dict, cwd: str, path: list) -> None:
        """The caller's environment, working directory and `sys.path`: what a process spawned now would get."""
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.path[:] = path

    def reset(self) -> None:
        """After a target. A ZeRO-3 engine replaces `torch.nn.functional.linear` for the rest of the process
        (DeepSpeed: "This will persist unless manually reset"): put back, as in a process that never ran one."""
        import torch
        import torch.nn.functional as F

        torch.set_default_dtype(self.dtype)
        torch.set_num_threads(self.threads)
        torch.set_rng_state(self.rng)
        torch.set_grad_enabled(True)
        F.linear = self.linear

    def leaks(self) -> list[str]:
        """The state a fresh process would not have and that cannot be put back: the worker retires."""
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        found = []
        if dist.is_available() and dist.is_initialized():
            found.append("a default process group")
        if dist.is_available() and dist.distributed_c10d._world.pg_map:
            found.append("process groups")
        if (F.linear is not self.linear or torch.Tensor.__new__ is not self.tensor_new
                or (torch.nn.Module.apply, torch.nn.Module.__dict__.get("__init_subclass__")) != self.module_hooks):
            found.append("torch patched (a ZeRO-3 Init context)")
        groups = sys.modules.get("deepspeed.utils.groups")
        if groups is not None and groups._WORLD_GROUP is not None:
            found.append("DeepSpeed's world group")
        zero = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
        if zero is not None and (zero.zero_init_context or zero.top_level_context is not None):
            found.append("a ZeRO-3 Init context")
        return found


def _teardown() -> None:
    """The target's process group destroyed (gloo's threads left running can abort a process, "terminate
    called without an active exception"), through DeepSpeed when it adopted it so that it drops its groups
    too, and DeepSpeed's backend forgotten: the next target's `init_distributed` builds its own, as in a fresh
    process."""
    import torch.distributed as dist

    comm = sys.modules.get("deepspeed.comm.comm")
    if dist.is_available() and dist.is_initialized():
        if comm is not None and comm.cdb is not None and comm.cdb.is_initialized():
            comm.destroy_process_group()
        else:
            dist.destroy_process_group()
    if comm is not None:
        comm.cdb = None


def _worker(conn) -> None:
    """Runs `(target, rank, world, port, args, env, cwd, path)` jobs until the pool closes its end."""
    import gc

    fresh = _Fresh()
    while True:
        try:
            target, rank, world, port, args, env, cwd, path = conn.recv()
        except EOFError:
            return
        fresh.arrive(env, cwd, path)
        out = {}
        try:
            target(rank, world, port, *args, out)
            reply = ("ok", pickle.dumps(out))
        except BaseException:
            reply = ("error", traceback.format_exc())
        finally:
            _teardown()
            out = None
            gc.collect()
            fresh.reset()
        leaks = fresh.leaks()
        conn.send((*reply, leaks))
        if leaks or reply[0] != "ok":
            return


class _Pool:
    def __init__(self):
        self.workers = []  # (process, connection)

    def start(self, n: int) -> None:
        """At least `n` live workers."""
        ctx = mp.get_context("spawn")
        self.workers = [(p, c) for p, c in self.workers if p.is_alive()]
        while len(self.workers) < n:
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(theirs,), daemon=True, name=f"rank-worker-{len(self.workers)}")
            p.start()
            theirs.close()
            self.workers.append((p, mine))

    def close(self, wait_s: float = 0.0) -> None:
        """Each worker told to stop (its end of the pipe closed: it exits when idle), killed if still running
        after `wait_s` (one blocked in a collective of a failed call never would)."""
        for p, c in self.workers:
            c.close()
        deadline = time.monotonic() + wait_s
        for p, c in self.workers:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        self.workers = []

    def run(self, target, world: int, args: tuple, timeout_s: float) -> dict:
        self.start(world)
        workers = self.workers[:world]
        port = free_port()
        for rank, (_, conn) in enumerate(workers):
            conn.send((target, rank, world, port, args, dict(os.environ), os.getcwd(), list(sys.path)))
        outs, failures, retired = {}, [], []
        deadline = time.monotonic() + timeout_s
        pending = dict(enumerate(workers))
        while pending and not failures:
            ready = wait([c for _, c in pending.values()] + [p.sentinel for p, _ in pending.values()],
                         max(0.0, deadline - time.monotonic()))
            if not ready:
                failures += [f"rank {rank} hung past {timeout_s} s" for rank in pending]
            for rank, (p, conn) in list(pending.items()):
                if conn in ready or p.sentinel in ready:
                    try:
                        status, value, leaks = conn.recv()
                    except EOFError:
                        p.join()
                        failures.append(f"rank {rank} exited with code {p.exitcode}")
                        continue
                    del pending[rank]
                    if status != "ok":
                        failures.append(f"rank {rank} raised:\n{value}")
                    else:
                        outs[rank] = pickle.loads(value)
                    if leaks:
                        retired.append((p, conn))
                        warnings.warn(f"rank {rank}'s worker retired, its state not a fresh process's: {leaks}")
        if failures:  # the other ranks may be blocked in a collective: none of these processes is reused
            self.close()
            raise AssertionError("a rank failed or hung: " + "\n".join(failures))
        for p, conn in retired:
            conn.close()
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
            self.workers.remove((p, conn))
        merged = {}
        for rank in range(world):
            merged.update(outs[rank])
        return merged


_POOL = _Pool()
atexit.register(_POOL.close, 30.0)  # where the interpreter finalizes (pytest's run here ends in os._exit: the
# workers then see their pipe close and exit on their own)


def run_ranks(target, world: int, *args, timeout_s: float = 240) -> dict:
    """`target(rank, world, port, *args, out)` as `world` ranks of a fresh process group in the pool's
    workers; returns `out`, the dict the ranks write their results into (each rank its own keys). Fails,
    with the ranks' tracebacks, if a rank raises, dies or hangs past `timeout_s`."""
    try:
        return _POOL.run(target, world, args, timeout_s)
    except BaseException:
        _POOL.close()  # a job left half-done (a test's timeout interrupting the wait): no worker is reused
        raise
