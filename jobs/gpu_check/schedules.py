"""Part 2: the rollout schedules on one engine on the device, in process (as `jobs.bench.schedule` runs them on
CPU): sync, APRIL at N'/N 1.5 and 2, and the over-provisioned baseline at the same N', each with its own
engine (one shared model: the engines share its weights, each has its own KV cache), source and store, run
interleaved step by step, beside the simulator's prediction for one engine with the cost curve fitted to
these same steps (and with the roofline's).

A random-weight model never says when it is done, so each sample's budget is the length the simulator's
mix draws for it (`DrawnLengthSource`): a response ends where the simulator's does, sample by sample, and
the simulation (same prompts, seed and ids) replays exactly the lengths measured here.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np

from april_ray.config import RolloutConfig, StalenessConfig, over_sampling_batch_size
from april_ray.rollout.prompt_source import PromptSource
from jobs.gpu_check.common import (Deadline, Scale, build_model, device_name, free, length_mix, roofline,
                                   simulate_defaults)
from jobs.gpu_check.engine import WallStepRecorder, saturate

PAPER_STALENESS = StalenessConfig(max_versions=4, policy="mask")
"""configs/qwen3_4b_dapo.yaml's staleness section."""
SIMULATION_S = 10.0
"""Kept for the simulations after the measured rounds (a few seconds of CPU at the GPU check's scale)."""


class DrawnLengthSource(PromptSource):
    """The prompt source, each sample's budget the length the simulator draws for its prompt row and id."""

    def __init__(self, examples, encode, n_samples_per_prompt: int, budget: int, seed: int, lengths):
        super().__init__(examples, encode, n_samples_per_prompt, budget, seed)
        self.lengths = lengths

    def take(self, num_groups: int, step: int = 0):
        return [dataclasses.replace(g, samples=[self._drawn(s, g.prompt_index) for s in g.samples])
                for g in super().take(num_groups, step)]

    def _drawn(self, sample, row: int):
        budget = min(self.max_response_len, self.lengths(row, sample.sample_id))
        return dataclasses.replace(sample, max_response_len=budget)


class Mode:
    """One schedule on its own engine, source and store (jobs/bench/schedule.py's LocalMode, on the device)."""

    def __init__(self, name: str, rollout: RolloutConfig, model, cap: int, scale: Scale, prompts):
        from april_ray.engine.async_engine import AsyncEngine
        from april_ray.engine.cpu_engine import LLMEngine
        from april_ray.rollout.engine_worker import EngineWorker
        from april_ray.rollout.local import LocalPool, LocalProxy
        from april_ray.rollout.monitor import CompletionMonitor
        from april_ray.rollout.store import PartialRolloutStore
        from april_ray.types import SamplingParams
        from jobs.bench.steplog import StepLog

        lengths, prompt_len, budget = length_mix(scale)
        self.name, self.rollout = name, rollout
        core = LLMEngine(model, cap, prompt_len + budget + 1, max_prefill_tokens=1 << 16)
        self.recorder = WallStepRecorder(core)
        self.worker = EngineWorker(AsyncEngine(core), lambda ids: "", lambda prompt, response, answer: 0.0,
                                   SamplingParams(max_new_tokens=budget))
        examples, encode = prompts
        self.source = DrawnLengthSource(examples, encode, rollout.n_samples_per_prompt, budget,
                                        simulate_defaults().seed, lengths)
        self.store = PartialRolloutStore(PAPER_STALENESS)
        self.monitor = CompletionMonitor(rollout, LocalPool([self.worker], [cap]), LocalProxy(self.source),
                                         LocalProxy(self.store), PAPER_STALENESS)
        self.log = StepLog(rollout.n_samples_per_prompt)

    async def step(self, step: int, measured: bool) -> None:
        self.worker.update_weights(None, step)  # a stand-in learner made version `step`
        before = self.worker.stats(drain=True)
        t0 = time.perf_counter()
        result = await self.monitor.step(step, step)
        dt = time.perf_counter() - t0
        self.recorder.boundary()
        after = self.worker.stats(drain=True)
        if measured:
            self.log.add(dt, result, len(self.store), [before], [after])

    def result(self, ceiling: float) -> dict:
        m = self.monitor
        lost = self.source.num_groups_taken - m.num_returned_groups - m.num_dropped_groups - len(self.store)
        res = self.log.summary(1, lost)
        keep = ("effective_tok_s", "generated_tok_s", "off_policy_token_ratio", "masked_token_ratio", "wall_s",
                "steps", "trained_tokens", "running_rows_mean", "lost_samples", "duplicated_samples",
                "engine_busy_fraction")  # the engine's steps over the mode's wall: the rest is the control plane's
        return {k: res[k] for k in keep} | {"utilization": res["effective_tok_s"] / ceiling,
                                            "over_sampling_batch_size": self.rollout.over_sampling_batch_size}


def modes_for(scale: Scale) -> list[tuple[str, RolloutConfig]]:
    n = scale.rollout_groups
    base = RolloutConfig(rollout_batch_size=n, over_sampling_batch_size=n, n_samples_per_prompt=scale.n_samples)
    out = [("sync", dataclasses.replace(base, schedule="sync"))]
    for f in scale.factors:
        for schedule in ("april", "oversample"):
            over = over_sampling_batch_size(f, n)
            rollout = dataclasses.replace(base, schedule=schedule, over_sampling_batch_size=over)
            out.append((f"{schedule}_{f:g}", rollout))
    return out


def run(scale: Scale, device, dtype, deadline: Deadline) -> dict:
    shape = scale.shapes["Qwen3-0.6B"]
    model = build_model(shape, device, dtype)
    lengths, prompt_len, budget = length_mix(scale)
    configs = modes_for(scale)
    cap = max(r.over_sampling_batch_size for _, r in configs) * scale.n_samples
    prompts = prompt_set(shape["vocab_size"], prompt_len)
    modes = [Mode(name, r, model, cap, scale, prompts) for name, r in configs]
    result = asyncio.run(measure(modes, model, scale, cap, deadline))
    del modes, model
    free(device)
    fit = fit_of(result.pop("recorded"))
    steps = min(m["steps"] for m in result["measured"].values()) if result["measured"] else 0
    sims = simulate(scale, configs, cap, steps, fit, roofline(shape, device_name(device))) if steps else {}
    sync = result["measured"].get("sync", {}).get("utilization")
    rows = {}
    for name, measured in result["measured"].items():
        sim = sims.get(name, {})
        rows[name] = measured | {f"simulated_{k}": v for k, v in sim.items()}
        if sync:
            rows[name]["gain_over_sync"] = measured["utilization"] / sync
    return {"modes": rows, "ceiling_tok_s": result["ceiling_tok_s"], "step_cost_fit": fit,
            "setting": {"shape": "Qwen3-0.6B", "rollout_batch_size": scale.rollout_groups,
                        "n_samples_per_prompt": scale.n_samples, "max_num_seqs": cap, "prompt_len": prompt_len,
                        "budget": budget, "length_scale": scale.length_scale, "mean_length": lengths.mean(),
                        "warmup_steps": scale.warmup_steps, "staleness": dataclasses.asdict(PAPER_STALENESS)},
            "stopped_early": result["stopped_early"]}


def prompt_set(vocab: int, prompt_len: int):
    """The simulator's dataset (sim/config.py num_prompts rows), each prompt random ids of the mix's length:
    the source's order, hence every sample's id and drawn length, is the simulation's."""
    from april_ray.task.data import Example

    num = simulate_defaults().num_prompts
    rng = np.random.default_rng(2)
    ids: dict[int, list[int]] = {}

    def encode(text: str) -> list[int]:
        return ids.setdefault(int(text), rng.integers(2, vocab, prompt_len).tolist())

    return [Example(row, str(row), "") for row in range(num)], encode


async def measure(modes: list[Mode], model, scale: Scale, cap: int, deadline: Deadline) -> dict:
    """Rounds of one step per mode, while the last round's time is left; the ceiling (the engine full on the
    mix, `engine.saturate`) before and after, on an engine of its own."""
    from april_ray.engine.async_engine import AsyncEngine
    from april_ray.engine.cpu_engine import LLMEngine

    lengths, prompt_len, budget = length_mix(scale)
    probe_core = LLMEngine(model, cap, prompt_len + budget + 1, max_prefill_tokens=1 << 16)
    probe_recorder = WallStepRecorder(probe_core)
    probe = AsyncEngine(probe_core)

    async def ceiling() -> float:
        tokens, seconds, _ = await saturate(probe, lengths, prompt_len, budget, cap, scale.probe_s,
                                            model.config.vocab_size, scale.n_samples)
        return tokens / seconds

    ceilings, round_s, stopped = [await ceiling()], 0.0, False
    for step in range(scale.warmup_steps + scale.steps):
        if deadline.left() < round_s + 2 * scale.probe_s + SIMULATION_S:
            stopped = True
            break
        t0 = time.perf_counter()
        for mode in modes:
            await mode.step(step, measured=step >= scale.warmup_steps)
        round_s = time.perf_counter() - t0
    ceilings.append(await ceiling())
    ceiling_tok_s = float(np.mean(ceilings))
    measured = {m.name: m.result(ceiling_tok_s) for m in modes if m.log.rows}
    recorded = [r for m in modes for r in m.recorder.rows] + probe_recorder.rows
    return {"measured": measured, "ceiling_tok_s": {"mean": ceiling_tok_s, "runs": ceilings},
            "recorded": recorded, "stopped_early": stopped}


def fit_of(recorded: list) -> dict:
    from sim.calibrate import COSTS, fit_costs

    return fit_costs(recorded) if len(recorded) >= len(COSTS) else {}


def simulate(scale: Scale, configs, cap: int, steps: int, fit: dict, gpu_cost) -> dict[str, dict]:
    """Each mode simulated (sim/study.py `run_schedule`): one engine with this run's cap, lengths and warm-up,
    its step cost fitted to the steps measured here, and again with the roofline's."""
    from sim import study
    from sim.calibrate import cpu_step_cost
    from sim.cluster import Setting
    from sim.workload import Workload

    lengths, prompt_len, budget = length_mix(scale)
    sim = simulate_defaults()
    workload = Workload(lengths, [prompt_len] * sim.num_prompts, 1, budget, 0.0, sim.seed)
    costs = {"fitted": cpu_step_cost(fit)} if fit else {}
    costs["roofline"] = gpu_cost
    out: dict[str, dict] = {name: {} for name, _ in configs}
    for label, cost in costs.items():
        setting = Setting(workload, cost, 1, cap, cap * (prompt_len + budget + 1), 1 << 16, PAPER_STALENESS,
                          seed=sim.seed)
        ceiling = study.ceiling_of(setting, scale.n_samples)
        for name, rollout in configs:
            res = study.run_schedule(setting, rollout, steps, scale.warmup_steps, "none", ceiling)
            out[name][f"utilization_{label}"] = res["utilization"]
            out[name][f"effective_tok_s_{label}"] = res["effective_tok_s"]
        sync = out["sync"][f"utilization_{label}"]
        for name in out:
            out[name][f"gain_over_sync_{label}"] = out[name][f"utilization_{label}"] / sync
    return out
