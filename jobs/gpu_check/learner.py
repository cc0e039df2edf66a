"""Part 3: one step of the plain `Learner` (april_ray/learn/learner.py) at the paper's settings
(configs/qwen3_4b_dapo.yaml: DAPO, bf16 with fp32 masters, gradient checkpointing, log-probs in 1,024-token
chunks, 32,768 tokens per micro-batch) on one device, at Qwen3-1.7B's shape and at as many of Qwen3-4B's
layers as the memory plan says fit; the allocator's peak against the plan of `jobs.plan`
(april_ray/learn/plan.py) for the same settings, step time and tokens per second.

No DeepSpeed here: the learner's torch backend (plain AdamW, autocast bf16 over fp32 weights, which are the
masters) is what one rank of ZeRO-0 holds, and the plan is asked for that backend. Attention is
flash_attention_2 where the flash-attn package is installed, with packed micro-batches (`learner.packing=auto`),
else sdpa over padded rows (packed rows would need a block mask there, which takes sdpa off its flash kernel;
the samples here are of one length, so the rows carry no padding).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import random
import time
from pathlib import Path

from jobs.gpu_check.common import Deadline, Scale, first_layers, free, model_dir

PAPER_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "qwen3_4b_dapo.yaml"
FITS_SHARE = 0.9
"""The 4B slice: the most layers whose planned peak is within this share of the device's memory."""


def attention(device) -> str:
    return "flash_attention_2" if device.type == "cuda" and importlib.util.find_spec("flash_attn") else "sdpa"


def paper_config(scale: Scale, device, model_path: str):
    """The paper's config for one torch-backend learner rank on this device (the plan's inputs too). Its
    placement stays the paper's, colocated, on one GPU (one rank, one engine): the plan's train phase then has
    the engine's memory released, which this check has no engine to hold anyway."""
    from april_ray.config import load_config

    overrides = [f"model.path={model_path}", "learner.backend=torch", "learner.num_ranks=1",
                 "engine.num_engines=1", "learner.zero_stage=0",
                 f"learner.attn_implementation={attention(device)}",
                 f"learner.micro_batch_tokens={scale.micro_batch_tokens}",
                 f"learner.gpus={int(device.type == 'cuda')}"]
    if scale.smoke:  # a CPU runs the step in float32 (bf16 matmuls are slow there) on a small budget
        overrides += ["learner.dtype=float32", f"engine.max_model_len={scale.micro_batch_tokens}",
                      f"sampling.max_response_len={scale.micro_batch_tokens // 2}", "algorithm.overlong_buffer=0"]
    return load_config(str(PAPER_CONFIG), overrides)


def memory_gb(device, cfg) -> float:
    import torch

    return torch.cuda.get_device_properties(device).total_memory / 1e9 if device.type == "cuda" \
        else cfg.learner.gpu_memory_gb


def planned(cfg, shape: dict, device):
    from april_ray.learn.plan import Shape, plan

    dtype_bytes = 4 if cfg.learner.dtype == "float32" else 2
    return plan(cfg, Shape.from_hf(shape), memory_gb(device, cfg), dtype_bytes=dtype_bytes)


def slice_layers(scale: Scale, device, cfg) -> int:
    """Qwen3-4B's layers, as many as the plan's train phase fits in FITS_SHARE of the memory (at least one;
    the colocated plan's rollout phase, the engine's pool beside the learner's states, is not measured here)."""
    shape = scale.shapes["Qwen3-4B"]
    room = FITS_SHARE * memory_gb(device, cfg)
    for layers in range(shape["num_hidden_layers"], 0, -1):
        if planned(cfg, shape | {"num_hidden_layers": layers}, device).phases["train"] <= room:
            return layers
    return 1


def run(scale: Scale, device, work: Path, deadline: Deadline, progress) -> dict:
    """1.7B, then the 4B slice; a slice the allocator cannot hold after all is recorded, and a smaller one
    (three quarters of its layers) tried while time is left. `progress` is told each result as it comes."""
    out: dict = {"attention": attention(device)}
    small, four = scale.shapes["Qwen3-1.7B"], scale.shapes["Qwen3-4B"]
    if not deadline.passed():
        out["Qwen3-1.7B"] = one_shape(scale, device, model_dir(work, "Qwen3-1.7B", small, device), small)
        free(device)
        progress(out)
    layers = slice_layers(scale, device, paper_config(scale, device, "Qwen3-4B"))
    while not deadline.passed():
        full = model_dir(work, "Qwen3-4B", four, device)
        path = full if layers == four["num_hidden_layers"] else first_layers(full, layers)
        res = out[f"Qwen3-4B_{layers}_layers"] = one_shape(scale, device, path, four | {"num_hidden_layers": layers})
        free(device)
        progress(out)
        if "error" not in res or layers == 1:
            break
        layers = max(1, layers * 3 // 4)
    return out | {"stopped_early": deadline.passed()}


def samples(scale: Scale, vocab: int, prompt: int = 256) -> list:
    """The micro-batch: samples of `sample_tokens` (a 256-token prompt, or a quarter on a smoke budget) that
    fill `micro_batch_tokens`, one group, rewards alternating."""
    from april_ray.types import FinishReason, Sample, SampleState

    rng, n = random.Random(0), scale.sample_tokens
    prompt = min(prompt, n // 4)
    out = []
    for i in range(scale.micro_batch_tokens // n):
        response = [rng.randrange(3, vocab) for _ in range(n - prompt)]
        out.append(Sample(f"g/{i}", "g", "p", "a", [rng.randrange(3, vocab) for _ in range(prompt)], n - prompt,
                          response_ids=response, logprobs=[-12.0] * len(response), versions=[0] * len(response),
                          state=SampleState.FINISHED, finish_reason=FinishReason.STOP, reward=float(i % 2)))
    return out


def one_shape(scale: Scale, device, path: Path, shape: dict) -> dict:
    """A small step first (the optimiser's states exist from then on), one of the full size, then the measured
    one."""
    import torch

    cfg = paper_config(scale, device, str(path))
    plan = planned(cfg, shape, device)
    try:
        res = measured_step(scale, device, path, shape, cfg) | plan_beside(plan)
        return res | {"plan_over_peak": res["plan_gb"] / res["peak_gb"]}
    except torch.cuda.OutOfMemoryError as e:
        return {"error": f"out of memory: {str(e).splitlines()[0]}", "layers": shape["num_hidden_layers"],
                "plan": plan.to_json()}


def measured_step(scale: Scale, device, path: Path, shape: dict, cfg) -> dict:
    import torch

    from april_ray.learn.learner import Learner

    t0 = time.perf_counter()
    learner = Learner(str(path), cfg.learner, cfg.algorithm, cfg.sampling.temperature, cfg.sampling.max_response_len,
                      staleness=cfg.staleness, device=str(device))
    load_s = time.perf_counter() - t0
    batch = samples(scale, shape["vocab_size"])
    learner.train_step([dataclasses.replace(s, response_ids=s.response_ids[:4], logprobs=s.logprobs[:4],
                                            versions=s.versions[:4]) for s in batch[:2]], version=0)
    held = sum(t.numel() * t.element_size() for t in learner.module.parameters())
    held += sum(t.numel() * t.element_size() for state in learner.optimizer.state.values() for t in state.values()
                if torch.is_tensor(t))
    # On a GPU the first step of its size picks its kernels: it is timed beside, not the figure. (On CPU the
    # resident peak shows only in a process's first step of a size, so that one is measured.)
    first_step_s = None
    if device.type == "cuda":
        t0 = time.perf_counter()
        learner.train_step(batch, version=0)
        torch.cuda.synchronize(device)
        first_step_s = time.perf_counter() - t0
    peak = Peak(device, held)
    metrics = learner.train_step(batch, version=0)
    step_s = peak.stop()
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in batch)
    return {"layers": shape["num_hidden_layers"], "tokens": tokens, "step_s": step_s, "first_step_s": first_step_s,
            "tokens_per_s": tokens / step_s,
            "load_s": load_s, "peak_gb": peak.peak_gb, "reserved_gb": peak.reserved_gb, "peak_source": peak.source,
            "packed": learner.packed, "grad_norm": metrics["train/grad_norm"],
            "micro_batches": metrics["train/num_micro_batches"]}


def plan_beside(plan) -> dict:
    """The plan's train phase less the CUDA contexts (the allocator does not see them), over the measured peak."""
    return {"num_params": plan.notes["num_params"], "plan": plan.to_json(),
            "plan_gb": plan.phases["train"] - plan.parts.get("cuda_context", 0.0)}


class Peak:
    """The step's peak memory: the CUDA allocator's on a GPU; on CPU the process's resident peak over its
    resident memory before the step, plus the weights and optimiser states it held already."""

    def __init__(self, device, held_bytes: int):
        import torch

        self.device, self.held, self.t0 = device, held_bytes, time.perf_counter()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.source = "torch.cuda.max_memory_allocated"
        else:
            self.before = _status("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            self.source = "VmHWM over VmRSS before the step (CPU)"

    def stop(self) -> float:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak_gb = torch.cuda.max_memory_allocated() / 1e9
            self.reserved_gb = torch.cuda.max_memory_reserved() / 1e9
        else:
            self.peak_gb = self.reserved_gb = (_status("VmHWM") - self.before + self.held) / 1e9
        return time.perf_counter() - self.t0


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")
