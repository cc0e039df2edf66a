"""Part 1: our engine (`LLMEngine`, the model on the device in bf16) at Qwen3-0.6B's and Qwen3-1.7B's shapes.

For each shape: uniform batches (rows x context tokens) timed step by step, the throughput curve by
concurrency with the roofline's step beside each point; the engine kept full on the simulator's length mix
(`saturated`: each finished request replaced at once by the next sample of the mix) beside the simulator's
ceiling for the same mix under the roofline's costs and under the fitted ones; and the fit of every recorded
step (sim/calibrate.py `fit_costs`: fixed cost per step, per row, per token of context, per prefilled token),
the simulator's calibration inputs, beside the roofline's own coefficients.
"""
from __future__ import annotations

import asyncio
import itertools
import time

import numpy as np

from jobs.bench.steplog import StepRecorder
from jobs.gpu_check.common import (Deadline, Scale, build_model, device_name, free, length_mix, roofline,
                                   simulate_defaults)
from sim.calibrate import COSTS, cpu_step_cost, fit_costs


class WallStepRecorder(StepRecorder):
    """A GPU step waits on the device (`LLMEngine._sample` reads the tokens back): its wall time is its cost."""

    clock = staticmethod(time.perf_counter)


def run(scale: Scale, device, dtype, deadline: Deadline, progress) -> dict:
    """Each shape in its share of the part's time; `progress` is told each shape's result as it comes."""
    shapes = ["Qwen3-0.6B", "Qwen3-1.7B"]
    out = {}
    for i, name in enumerate(shapes):
        share = Deadline(time.time() + deadline.left() / (len(shapes) - i))
        out[name] = one_shape(scale.shapes[name], scale, device, dtype, share) if not deadline.passed() else \
            {"skipped": "the part's budget was spent"}
        progress(out)
    return out


def one_shape(shape: dict, scale: Scale, device, dtype, deadline: Deadline) -> dict:
    t0 = time.perf_counter()
    model = build_model(shape, device, dtype)
    built_s = time.perf_counter() - t0
    cost = roofline(shape, device_name(device))
    recorded: list[tuple] = []
    grid = time_grid(model, shape["vocab_size"], scale, cost, deadline, recorded)
    profile = decode_profile(model, shape["vocab_size"], scale) if not deadline.passed() else {}
    mix = []
    for c in scale.mix_concurrency:
        free(device)  # the last engine's KV cache
        if not deadline.passed():
            mix.append(mix_throughput(model, scale, c, deadline, recorded))
    del model
    free(device)
    fit = fit_costs(recorded) if len(recorded) >= len(COSTS) else {}
    for m in mix:
        m |= simulated_ceilings(scale, m["concurrency"], cost, fit)
    return {"model_built_s": built_s, "by_concurrency": grid, "decode_profile": profile, "length_mix": mix,
            "step_cost": {"fit": fit, "roofline": roofline_terms(cost),
                          "what": "step = a + b x rows + c x context tokens + prefill_per_token x prefilled "
                                  "(+ the other features of sim/calibrate.py FEATURES), least squares over every "
                                  "step recorded here; the roofline's step is t0 + max(memory line, compute line)"},
            "stopped_early": deadline.passed()}


def roofline_terms(cost) -> dict:
    """The roofline's coefficients, beside the fit's: `fixed_per_step` (t0 plus reading the weights) is the
    fit's `a`, `compute_per_row` its `b`, `memory_per_context_token` its `c`."""
    (ma, _, mc), (_, cb, cc) = cost.terms
    return {"fixed_per_step": cost.t0 + ma, "t0": cost.t0, "memory_a": ma, "memory_per_context_token": mc,
            "compute_per_row": cb, "compute_per_context_token": cc, "prefill_per_token": cost.prefill_per_token,
            "prefill_per_pair": cost.prefill_per_pair}


def time_grid(model, vocab: int, scale: Scale, cost, deadline: Deadline, recorded: list) -> list[dict]:
    """Each point: `rows` prompts of `context` tokens admitted, then decode steps; its decode step is the
    median of the steps that decoded every row (the first after a prefill included: none are dropped)."""
    from april_ray.engine.cpu_engine import LLMEngine
    from april_ray.types import GenerateRequest, SamplingParams

    steps, rng = scale.grid_decode_steps, np.random.default_rng(0)
    engine = LLMEngine(model, max(scale.grid_rows), max(scale.grid_contexts) + steps + 2, max_prefill_tokens=1 << 16)
    sp = SamplingParams(temperature=1.0, max_new_tokens=steps + 1)
    engine.generate([GenerateRequest(f"warm{i}", rng.integers(2, vocab, 16).tolist(), sp) for i in range(4)])
    recorder = WallStepRecorder(engine)
    points = []
    for ctx, rows in itertools.product(scale.grid_contexts, scale.grid_rows):
        if deadline.passed():
            break
        n0 = len(recorder.rows)
        engine.generate([GenerateRequest(f"g{ctx}-{rows}-{i}", rng.integers(2, vocab, ctx).tolist(), sp)
                         for i in range(rows)])
        done = recorder.rows[n0:]
        decode = [r for r in done if r[3] == 0 and r[1] == rows]  # no prefill in it, every row decoding
        if not decode:  # admitted over more steps than it decodes: no step ran the whole batch alone
            continue
        prefill = sum(r[-1] for r in done if r[3] > 0)
        step_s = float(np.median([r[-1] for r in decode]))
        context = float(np.mean([r[2] for r in decode]))
        predicted = cost.step(rows, context)
        points.append({"rows": rows, "context_per_row": context / rows, "decode_step_s": step_s,
                       "tok_s": rows / step_s, "prefill_s": prefill, "roofline_step_s": predicted,
                       "roofline_tok_s": rows / predicted, "measured_over_roofline": step_s / predicted})
    recorded += recorder.rows
    return points


def decode_profile(model, vocab: int, scale: Scale, steps: int = 5) -> dict:
    """Where a decode step of the most rows the grid runs (64-token prompts) goes, from torch.profiler over
    `steps` steps after two: its wall time, the host's time in PyTorch's ops, the device's time in kernels and
    copies and how many ran (launch-bound: the host's time is the step, the device's a fraction of it), and
    the ops that took the host longest."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from april_ray.engine.cpu_engine import LLMEngine
    from april_ray.types import GenerateRequest, SamplingParams

    rows, rng = max(scale.grid_rows), np.random.default_rng(3)
    engine = LLMEngine(model, rows, 64 + steps + 4, max_prefill_tokens=1 << 16)
    sp = SamplingParams(temperature=1.0, max_new_tokens=steps + 3)
    for i in range(rows):
        engine.add_request(GenerateRequest(f"p{i}", rng.integers(2, vocab, 64).tolist(), sp))
    engine.step()  # the prefill
    engine.step()
    cuda = engine.runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()  # each reads its tokens back: the device is done when it returns
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    host = sum(e.self_cpu_time_total for e in events) / 1e6
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:5]
    return {"rows": rows, "steps": steps, "step_s": wall / steps, "host_op_s_per_step": host / steps,
            "device_s_per_step": sum(e.self_device_time_total for e in kernels) / 1e6 / steps if cuda else None,
            "device_ops_per_step": sum(e.count for e in kernels) / steps if cuda else None,
            "top_host_ops": [{"op": e.key, "s_per_step": e.self_cpu_time_total / 1e6 / steps,
                              "calls_per_step": e.count / steps} for e in top]}


def mix_throughput(model, scale: Scale, concurrency: int, deadline: Deadline, recorded: list) -> dict:
    """`concurrency` lanes, each replacing its finished request at once with the next sample of the mix (the
    simulator's `saturated` draws the same samples: same ids, same rows), tokens counted over `probe_s` after a
    warm-up of the same length."""
    from april_ray.engine.async_engine import AsyncEngine
    from april_ray.engine.cpu_engine import LLMEngine

    lengths, prompt_len, budget = length_mix(scale)
    core = LLMEngine(model, concurrency, prompt_len + budget + 1, max_prefill_tokens=1 << 16)
    recorder = WallStepRecorder(core)
    engine = AsyncEngine(core)
    window = min(scale.probe_s, max(0.1, deadline.left() / 3))
    tokens, seconds, rows = asyncio.run(saturate(engine, lengths, prompt_len, budget, concurrency, window,
                                                 model.config.vocab_size, scale.n_samples))
    recorded += recorder.rows
    return {"concurrency": concurrency, "tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds,
            "running_rows_mean": rows, "prompt_len": prompt_len, "budget": budget,
            "mean_length": lengths.mean(), "length_scale": scale.length_scale}


async def saturate(engine, lengths, prompt_len: int, budget: int, concurrency: int, seconds: float, vocab: int,
                   n_samples: int) -> tuple[int, float, float]:
    from april_ray.types import GenerateRequest, SamplingParams

    rng, num_prompts = np.random.default_rng(1), simulate_defaults().num_prompts
    prompts: dict[int, list[int]] = {}
    counter, stop = itertools.count(), False

    async def lane() -> None:
        while not stop:
            i = next(counter)
            row = (i // n_samples) % num_prompts
            key = f"probe-e0p{row}s{i % n_samples}"
            ids = prompts.setdefault(row, rng.integers(2, vocab, prompt_len).tolist())
            sp = SamplingParams(max_new_tokens=min(budget, lengths(row, key)))
            await engine.generate(GenerateRequest(f"{key}@probe", ids, sp))

    lanes = [asyncio.ensure_future(lane()) for _ in range(concurrency)]
    await asyncio.sleep(seconds)  # the lanes start in lockstep: let them spread out
    st0 = engine.stats(drain=False)
    n0, k0, t0 = st0.num_generated_tokens, len(st0.occupancy), time.perf_counter()  # (the list goes on growing)
    await asyncio.sleep(seconds)
    st, dt = engine.stats(drain=False), time.perf_counter() - t0
    stop = True
    engine.abort_all()
    await asyncio.gather(*lanes)
    occupancy = [n for _, n in st.occupancy[k0:]]
    return st.num_generated_tokens - n0, dt, float(np.mean(occupancy or [0]))


def simulated_ceilings(scale: Scale, concurrency: int, cost, fit: dict) -> dict:
    """The simulator's ceiling of one engine kept full on the same mix (`sim.study.ceiling_of`), under the
    roofline's step cost and under the cost fitted to this engine's steps."""
    from april_ray.config import StalenessConfig
    from sim import study
    from sim.cluster import Setting
    from sim.workload import Workload

    lengths, prompt_len, budget = length_mix(scale)
    sim = simulate_defaults()
    workload = Workload(lengths, [prompt_len] * sim.num_prompts, 1, budget, 0.0, sim.seed)

    def ceiling(step_cost) -> float:
        setting = Setting(workload, step_cost, 1, concurrency, concurrency * (prompt_len + budget + 1), 1 << 16,
                          StalenessConfig(), seed=sim.seed)
        return study.ceiling_of(setting, scale.n_samples)

    out = {"simulated_tok_s_roofline": ceiling(cost)}
    if fit:
        out["simulated_tok_s_fitted"] = ceiling(cpu_step_cost(fit))
    return out
