"""Part 4: the colocated channel's weight handoff (engine.weight_sync=tensor) at Qwen3-1.7B's shape: this
process is the learner, our engine's HTTP server (april_ray/engine/http_server.py, bf16, on the same device)
is the engine process, and each update goes through `engine.weight_handoff.send_tensors` (CUDA IPC handles on a GPU,
shared memory on CPU) into the server's `/update_weights_from_tensor`. The learner's side is the torch
backend's `full_weights` (april_ray/learn/optim.py): every tensor under its first name, so the tied head is
not sent. After the updates one greedy request checks that the server serves the last version.
`s_per_update` leaves out the first update, which pays one-time costs; `seconds` keeps every one.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

from jobs.gpu_check.common import Deadline, Scale, build_model, model_dir

SERVER_MAX_LEN = 64


def run(scale: Scale, device, dtype, work: Path, deadline: Deadline) -> dict:
    import torch

    from april_ray.config import EngineConfig, LearnerConfig
    from april_ray.engine.sglang_server import CPUServerLauncher, ServerOptions
    from april_ray.learn.optim import TorchOptim

    shape = scale.shapes["Qwen3-1.7B"]
    path = model_dir(work, "Qwen3-1.7B", shape, device)
    t0 = time.perf_counter()
    opts = ServerOptions(str(path), device=str(device), max_num_seqs=4, max_model_len=SERVER_MAX_LEN,
                         startup_timeout_s=max(30.0, deadline.left()), log_dir=str(work / "logs"),
                         extra_args=["--dtype", str(dtype).removeprefix("torch.")])
    server = CPUServerLauncher().start(opts)
    started_s = time.perf_counter() - t0
    try:
        optim = TorchOptim(build_model(shape, device, dtype), LearnerConfig(backend="torch"))
        with optim.full_weights() as named:
            result = asyncio.run(hand_over(server, named, scale.updates, EngineConfig().weight_bucket_mb, deadline))
        skipped = sorted(set(optim.module.state_dict()) - {n for n, _ in named})
    finally:
        server.stop()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    seconds = result["seconds"][1:] or result["seconds"]
    per_update = sum(seconds) / len(seconds) if seconds else None
    return result | {"server_start_s": started_s, "skipped": skipped, "tensors": len(named),
                     "gb": result["bytes"] / 1e9, "s_per_update": per_update,
                     "gb_per_s": result["bytes"] / 1e9 / per_update if seconds else None,
                     "dtype": str(dtype).removeprefix("torch."), "bucket_mb": EngineConfig().weight_bucket_mb,
                     "server": str(device), "stopped_early": result["updates"] < scale.updates}


async def hand_over(server, named, updates: int, bucket_mb: float, deadline: Deadline) -> dict:
    from april_ray.engine.weight_handoff import send_tensors
    from april_ray.engine.sglang_client import SGLangEngine
    from april_ray.types import GenerateRequest, SamplingParams

    client = SGLangEngine(server.url, max_model_len=SERVER_MAX_LEN, server=server)
    seconds: list[float] = []
    try:
        for version in range(1, updates + 1):
            if deadline.left() < 2 * max(seconds, default=1.0):
                break
            t0 = time.perf_counter()
            await send_tensors(client, named, version, flush_cache=True, bucket_mb=bucket_mb)
            seconds.append(time.perf_counter() - t0)
            client.update_weights(None, version)
        out = await client.generate(GenerateRequest("check", [5, 6, 7, 8], SamplingParams(0.0, max_new_tokens=4)))
    finally:
        await client.close()
    return {"seconds": seconds, "updates": len(seconds), "bytes": sum(t.numel() * t.element_size() for _, t in named),
            "served_version_after": sorted(set(out.versions)), "expected_version": len(seconds)}
