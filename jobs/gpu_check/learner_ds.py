"""One learner step of each optimiser backend on the same batch, in this process: the torch backend (plain AdamW,
bf16 autocast over fp32 weights that are the masters) and DeepSpeed ZeRO-1 on one rank (NCCL on a GPU, gloo on
CPU; a bf16 module over fp32 masters in the optimiser), each built from one config with only `learner.backend`
(and the ZeRO stage) changed. The `job_shape` part runs it on the job's own batch at Qwen3-0.6B's shape, beside
the job's learner phase; `learner.py` holds the paper-settings torch step at larger shapes.

Each backend: its load, a first step (which picks its kernels and makes the optimiser's states), then the
measured step with the allocator's peak (`learner.Peak`), and the memory plan (`jobs.plan`) for that backend.
"""
from __future__ import annotations

import dataclasses
import time
import traceback

from jobs.gpu_check.common import Deadline, free
from jobs.gpu_check.learner import Peak, memory_gb

BACKENDS = {"torch": 0, "deepspeed": 1}
"""Each backend with its ZeRO stage (the torch backend has none)."""


def both_backends(cfg, path: str, shape: dict, samples: list, device, deadline: Deadline) -> dict:
    """Torch first, then DeepSpeed (its process group stays for the rest of the process, so it comes last);
    a backend that would start past the deadline is skipped, and one that fails is recorded, each saying so."""
    out: dict = {}
    for backend, stage in BACKENDS.items():
        if deadline.passed():
            out[backend] = {"skipped": "the part's budget was spent"}
            continue
        backend_cfg = dataclasses.replace(cfg, learner=dataclasses.replace(cfg.learner, backend=backend,
                                                                           zero_stage=stage))
        try:
            out[backend] = one_backend(backend_cfg, path, shape, samples, device)
        except Exception as e:  # the other backend's figures still come back
            traceback.print_exc()
            out[backend] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        free(device)
    steps = [out[b].get("step_s") for b in BACKENDS]
    if all(steps):
        out["deepspeed_over_torch_step"] = steps[1] / steps[0]
    return out


def one_backend(cfg, path: str, shape: dict, samples: list, device) -> dict:
    import torch

    from april_ray.learn.learner import Learner
    from april_ray.process_groups import free_port

    t0 = time.perf_counter()
    learner = Learner(path, cfg.learner, cfg.algorithm, cfg.sampling.temperature, cfg.sampling.max_response_len,
                      staleness=cfg.staleness, master_port=free_port(), device=str(device))
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    learner.train_step(samples, version=0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    first_step_s = time.perf_counter() - t0
    peak = Peak(device, held_bytes(learner))
    metrics = learner.train_step(samples, version=0)
    step_s = peak.stop()
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    plan_gb, dtype = planned_gb(cfg, shape, device), learner.dtype
    del learner
    return {"backend": cfg.learner.backend, "zero_stage": cfg.learner.zero_stage, "dtype": str(dtype),
            "load_s": load_s, "first_step_s": first_step_s, "step_s": step_s, "tokens": tokens,
            "tokens_per_s": tokens / step_s, "peak_gb": peak.peak_gb, "reserved_gb": peak.reserved_gb,
            "peak_source": peak.source, "plan_gb": plan_gb, "plan_over_peak": plan_gb / peak.peak_gb,
            "micro_batches": metrics["train/num_micro_batches"], "grad_norm": metrics["train/grad_norm"]}


def planned_gb(cfg, shape: dict, device) -> float:
    """The plan's train phase for this backend in the dtype the learner resolves to, less the CUDA context
    (the allocator does not see it)."""
    from april_ray.learn.learner import resolve_dtype
    from april_ray.learn.plan import Shape, plan

    dtype_bytes = resolve_dtype(cfg.learner.dtype, device).itemsize
    p = plan(cfg, Shape.from_hf(shape), memory_gb(device, cfg), dtype_bytes=dtype_bytes)
    return p.phases["train"] - p.parts.get("cuda_context", 0.0)


def held_bytes(learner) -> int:
    """What the learner holds between steps: its module's tensors, and the optimiser's (DeepSpeed's wrapped
    optimiser holds the fp32 master partitions as its parameters), each tensor once (CPU's peak adds these)."""
    import torch

    inner = getattr(learner.optimizer, "optimizer", learner.optimizer)
    tensors = list(learner.module.parameters())
    tensors += [p for group in inner.param_groups for p in group["params"]]
    tensors += [t for state in inner.state.values() for t in state.values() if torch.is_tensor(t)]
    seen = {t.data_ptr(): t.numel() * t.element_size() for t in tensors if t.numel()}
    return sum(seen.values())
