"""The `job_shape` part: the training job at Qwen3-0.6B's shape, its step split into rollout, learner, weight sync
and the rest, beside the same step in process and the simulator's, so that what Ray and the actors cost on the
device is one number (`ray_cost`).

- The job: `python -m jobs.train` (configs/tiny_cpu.yaml) with `model.path` a random model of Qwen3-0.6B's shape
  as the other parts build it (`common.model_dir`: the published vocabulary of 151,936 ids, the project's
  tokenizer), synchronous (`rollout.schedule=sync`), the paper's N per engine as the schedules part has it (4
  groups of 8), the schedules part's budget (512 tokens; the countdown's prompts are 7 tokens, its mix's 8),
  one in-actor engine and one DeepSpeed ZeRO-1 rank in bundles of half the device each, weights through the
  object store; a few steps, evaluated and saved after the last only. The split is the median of the
  steps after the first (which picks kernels), from the job's own metrics.jsonl (`time/<phase>_s`; the rest:
  the step's wall less its phases, evaluation left out).
- In process, first, in this part's own process: the same rows on the same engine as the job's actor builds
  it (`LLMEngine` over `load_policy`'s float32 weights), then a learner step of each backend on the batch that
  rollout made (`learner_ds.py`: torch, and DeepSpeed ZeRO-1 on one rank, the job's).
- Simulated: the roofline's prefill and decode of those rows (sim/hardware.py, for the whole card and a bf16
  engine), the simulator's learner (6 x params x tokens at `simulate.learner_mfu`) and weight sync (the
  policy's bytes at `simulate.weight_sync_gb_s`).

A random model over 151,936 ids draws the end-of-sequence id about once in 151,936 tokens: every response
runs to the budget, the sync step's worst case (which the mix's longest of 32 samples reaches in 3 steps of 4
anyway: one sample in 22 reaches 512). The tokenizer decodes only its 99 ids (the rest decode to nothing), so the
reward never fires, every group's rewards are equal and GRPO's advantages are zero: the learner still takes
its full forward, backward and optimiser step, which is what is timed here.
"""
from __future__ import annotations

import asyncio
import statistics
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from jobs.gpu_check.common import (GPU_SCALE, SMOKE_SCALE, Deadline, device_name, free, model_dir, roofline,
                                   simulate_defaults)
from jobs.gpu_check.job import COMMON, CONFIG, launch, report, step_rows, steps
from jobs.gpu_check.learner_ds import both_backends

PHASES = ("rollout", "learner", "weight_sync")


@dataclass(frozen=True)
class ShapeScale:
    steps: int
    """The job's steps; the split is the median of those after the first."""
    rollout_rounds: int
    """In-process rollouts timed (after a short one that picks kernels)."""
    max_model_len: int
    size: tuple[str, ...]
    """Overrides of the job: evaluation set, placement."""


GPU_SHAPE = ShapeScale(steps=3, rollout_rounds=1, max_model_len=640,
                       size=("task.num_eval=8", "placement.engine_gpus=0.5", "learner.gpus=0.5"))
SMOKE_SHAPE = ShapeScale(steps=2, rollout_rounds=1, max_model_len=64,
                         size=("task.num_eval=4", "task.num_train=300"))


def run(smoke: bool, work: Path, deadline: Deadline, progress) -> dict:
    """In process first (it is short and bounded), then the job with the rest of the part's budget."""
    import torch
    from transformers import AutoTokenizer

    from april_ray.config import load_config

    scale, sizes = (SMOKE_SCALE, SMOKE_SHAPE) if smoke else (GPU_SCALE, GPU_SHAPE)
    device = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    shape = scale.shapes["Qwen3-0.6B"]
    path = model_dir(work, "Qwen3-0.6B", shape, device)
    out = work / "job_shape"
    overrides = job_overrides(scale, sizes, path, out)
    cfg = load_config(str(Path(__file__).resolve().parents[2] / CONFIG), overrides)
    rows = scale.rollout_groups * scale.n_samples
    prompts = prompt_rows(cfg, AutoTokenizer.from_pretrained(path), scale.rollout_groups)
    prompt_len = max(len(ids) for _, _, ids in prompts)
    result: dict = {"setting": {"shape": "Qwen3-0.6B", "vocab_size": shape["vocab_size"], "rows": rows,
                                "rollout_batch_size": scale.rollout_groups, "n_samples_per_prompt": scale.n_samples,
                                "prompt_tokens": prompt_len, "budget": scale.budget, "steps": sizes.steps,
                                "device": device_name(device)}}
    try:
        result["in_process"] = in_process(cfg, str(path), shape, prompts, device, sizes, deadline)
    except Exception as e:  # recorded, and the job runs all the same: its figures are worth the device time
        traceback.print_exc()
        result["in_process"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    free(device)  # the job's actors take the device next
    progress(result)
    result["job"] = report("job_shape", overrides, [launch(overrides, out, "run", deadline)], out)
    result["job"]["split"] = step_split(step_rows(out))
    tokens = rows * (prompt_len + scale.budget)  # every response runs to the budget (the docstring)
    result["simulated"] = simulated(shape, device, rows, prompt_len, scale.budget, tokens)
    result["ray_cost"] = ray_cost(result["job"]["split"], result["in_process"])
    return result


def job_overrides(scale, sizes: ShapeScale, path: Path, out: Path) -> list[str]:
    n = scale.rollout_groups
    return [*COMMON, f"model.path={path}", "rollout.schedule=sync", f"rollout.rollout_batch_size={n}",
            f"rollout.over_sampling_batch_size={n}", f"rollout.n_samples_per_prompt={scale.n_samples}",
            f"sampling.max_response_len={scale.budget}", f"engine.max_model_len={sizes.max_model_len}",
            f"engine.max_num_seqs={n * scale.n_samples}", "placement.colocate=false", *sizes.size,
            f"train.output_dir={out}", *steps(sizes.steps)]


def in_process(cfg, path: str, shape: dict, prompts: list, device, sizes: ShapeScale, deadline: Deadline) -> dict:
    rollout, samples = rollout_in_process(cfg, path, prompts, device, sizes.rollout_rounds)
    free(device)
    return {"rollout": rollout, "learner": both_backends(cfg, path, shape, samples, device, deadline)}


def rollout_in_process(cfg, path: str, rows: list, device, rounds: int) -> tuple[dict, list]:
    """The job's rows (`rows`: its task's prompts, each `n_samples_per_prompt` times) on the engine its actor
    builds (`_cpu_engine`), here: a short round first (kernels), then `rounds` of the full budget, timed; the
    last round's samples, scored by the task's reward, are the learner's batch."""
    from april_ray.engine.async_engine import AsyncEngine
    from april_ray.engine.cpu_engine import LLMEngine
    from april_ray.model import load_policy

    e, r = cfg.engine, cfg.rollout
    model, tok = load_policy(path)
    model.to(device)
    engine = AsyncEngine(LLMEngine(model, e.max_num_seqs, e.max_model_len, e.max_prefill_tokens, e.seed, 0,
                                   num_park_slots=e.park_slots, max_versions=cfg.staleness.max_versions))
    prompts = [row for row in rows for _ in range(r.n_samples_per_prompt)]
    outputs, seconds = asyncio.run(timed_rounds(engine, cfg, [ids for _, _, ids in prompts], rounds,
                                                tok.eos_token_id))
    dtype = str(next(model.parameters()).dtype)
    del engine, model
    samples = as_samples(cfg, tok, prompts, outputs)
    return {"step_s": statistics.median(seconds), "rounds_s": seconds, "engine_dtype": dtype,
            "prompt_tokens": sum(len(s.prompt_ids) for s in samples),
            "response_tokens": sum(len(s.response_ids) for s in samples),
            "reward_mean": sum(s.reward for s in samples) / len(samples)}, samples


def prompt_rows(cfg, tok, n: int) -> list[tuple[str, str, list[int]]]:
    """(prompt, answer, ids) of the task's first `n` generated rows, encoded as the job encodes a lone user turn
    (the tokenizer's chat template renders it as its bare text)."""
    from april_ray.task.registry import get_task

    rows = get_task(cfg.task.name).generate(cfg.task, n, cfg.task.seed)
    return [(row["prompt"], row["answer"], tok.encode(row["prompt"], add_special_tokens=False)) for row in rows]


async def timed_rounds(engine, cfg, prompts: list[list[int]], rounds: int, eos: int) -> tuple[list, list[float]]:
    """A round of 4 tokens, then `rounds` of the full budget, each timed, on one event loop (the engine's loop
    task lives on it): the last round's outputs and every round's seconds."""
    await generate(engine, cfg, prompts, 4, eos)
    seconds = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        outputs = await generate(engine, cfg, prompts, cfg.sampling.max_response_len, eos)
        seconds.append(time.perf_counter() - t0)
    return outputs, seconds


async def generate(engine, cfg, prompts: list[list[int]], budget: int, eos: int) -> list:
    from april_ray.types import GenerateRequest, SamplingParams

    s = cfg.sampling
    params = SamplingParams(s.temperature, s.top_p, s.top_k, budget, (eos,))
    return await asyncio.gather(*(engine.generate(GenerateRequest(f"r{i}", ids, params))
                                  for i, ids in enumerate(prompts)))


def as_samples(cfg, tok, prompts: list, outputs: list) -> list:
    from april_ray.task.registry import get_task
    from april_ray.types import FinishReason, Sample, SampleState

    task, n = get_task(cfg.task.name), cfg.rollout.n_samples_per_prompt
    return [Sample(f"g{i // n}/{i % n}", f"g{i // n}", prompt, answer, ids, cfg.sampling.max_response_len,
                   response_ids=list(o.token_ids), logprobs=list(o.logprobs), versions=[0] * len(o.token_ids),
                   state=SampleState.FINISHED, finish_reason=FinishReason.STOP,
                   reward=task.reward(prompt, tok.decode(o.token_ids, skip_special_tokens=True), answer))
            for i, ((prompt, answer, ids), o) in enumerate(zip(prompts, outputs))]


def step_split(rows: list[dict]) -> dict:
    """Each step's seconds by phase and the rest (its wall since the last step's row less its phases; evaluation
    is its own phase, left out of the step), the first step alone and the median of the others."""
    per_step, last = [], 0.0
    for row in rows:
        wall = row["time/wall_s"] - last
        last = row["time/wall_s"]
        phases = {p: row.get(f"time/{p}_s", 0.0) for p in PHASES}
        step = phases | {"rest": wall - sum(phases.values()) - row.get("time/eval_s", 0.0)}
        per_step.append(step | {"step": sum(step.values())})
    later = per_step[1:] or per_step
    median = {k: statistics.median(s[k] for s in later) for k in per_step[0]} if per_step else {}
    return {"first": per_step[0] if per_step else {}, "median": median, "per_step": per_step}


def simulated(shape: dict, device, rows: int, prompt_len: int, budget: int, tokens: int) -> dict:
    """The simulator's seconds for this step on the card: the roofline's prefill of `rows` prompts and `budget`
    decode steps of every row, the learner on `tokens`, one weight sync."""
    from sim.hardware import ACCELERATORS, spec_from_hf

    from jobs.gpu_check.common import accelerator_key

    sim = simulate_defaults()
    cost = roofline(shape, device_name(device))
    spec = spec_from_hf("model", shape | {"torch_dtype": "bfloat16"}, "april_ray/learn/plan.py KNOWN_SHAPES")
    acc = ACCELERATORS[accelerator_key(device_name(device))]
    rollout = cost.admission([(0, prompt_len)] * rows, admitted=rows) + cost.decode_span(rows, prompt_len, budget)
    learner = tokens * 6 * spec.num_params / (acc.flops * sim.learner_mfu)
    sync = spec.weight_bytes / (sim.weight_sync_gb_s * 1e9)
    return {"rollout": rollout, "learner": learner, "weight_sync": sync, "step": rollout + learner + sync,
            "learner_mfu": sim.learner_mfu, "weight_sync_gb_s": sim.weight_sync_gb_s}


def ray_cost(split: dict, in_proc: dict) -> dict:
    """The job's median step less the same rollout and DeepSpeed step in process: Ray, the actors, the object
    store's weight sync and the driver's bookkeeping, by phase and in all."""
    job, ds = split.get("median"), in_proc.get("learner", {}).get("deepspeed", {}).get("step_s")
    rollout = in_proc.get("rollout", {}).get("step_s")
    if not job or not ds or not rollout:
        return {}
    by_phase = {"rollout": job["rollout"] - rollout, "learner": job["learner"] - ds,
                "weight_sync": job["weight_sync"], "rest": job["rest"]}
    total = sum(by_phase.values())
    return {"seconds_per_step": total, "share_of_step": total / job["step"], "by_phase": by_phase,
            "in_process_step_s": rollout + ds}


def lines(res: dict) -> list[str]:
    """The table's lines of this part."""
    s, out = res["setting"], []
    job, proc = res.get("job", {}), res.get("in_process", {})
    head = f"job_shape ({s['shape']}, {s['rows']} rows x {s['budget']} tokens, {s['steps']} steps):"
    med = job.get("split", {}).get("median")
    out.append(head + (f" job exit {job.get('exit')}" if not med else
                       f" job step {med['step']:.2f} s = rollout {med['rollout']:.2f} + learner {med['learner']:.2f}"
                       f" + weight sync {med['weight_sync']:.2f} + rest {med['rest']:.2f}"))
    if "error" in proc:
        out.append(f"  in process: {proc['error']}")
    elif proc:
        learner = ", ".join(f"{b} {r['step_s']:.2f} s (peak {r['peak_gb']:.2f} GB, plan/peak {r['plan_over_peak']:.2f})"
                            for b, r in proc["learner"].items() if isinstance(r, dict) and "step_s" in r)
        out.append(f"  in process: rollout {proc['rollout']['step_s']:.2f} s; learner {learner}")
    if "simulated" in res:
        m = res["simulated"]
        out.append(f"  simulated: rollout {m['rollout']:.2f} s, learner {m['learner']:.2f} s, "
                   f"weight sync {m['weight_sync']:.3f} s")
    cost = res.get("ray_cost")
    if cost:
        out.append(f"  Ray and the actors: {cost['seconds_per_step']:+.2f} s a step "
                   f"({100 * cost['share_of_step']:.0f}% of the job's step)")
    if "error" in job:
        out.append("  " + job["error"].splitlines()[-1] if job["error"].strip() else "  (no output)")
    return out
