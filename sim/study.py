"""The simulator's studies: a GPU cluster at several sizes and over-provisioning factors, and the CPU
calibration, each schedule on a fresh virtual loop.

How a cluster of G GPUs is built from the config: engines of `placement.engine_gpus` GPUs each (the
tensor-parallel size; 1 if 0), G / TP of them; the rollout batch keeps the config's groups per engine
(N = rollout.rollout_batch_size x engines / engine.num_engines, so every engine carries the load the
config gives one engine), N' = factor x N; `rollout.max_filtered_groups` scales with N.
"""
from __future__ import annotations

import dataclasses
import time

from april_ray.config import Config, ConfigError, over_sampling_batch_size
from sim.clock import VirtualLoop, run_virtual
from sim.cluster import CONTROL_PLANE, OTHER, Schedule, Setting, saturated
from sim.config import SimulateConfig
from sim.hardware import ACCELERATORS, gpu_step_cost, kv_capacity_tokens, model_spec
from sim.workload import LengthModel, Workload, load_lengths_file


def token_block(cfg: Config, sim: SimulateConfig) -> int:
    """Tokens simulated as one: the configured one, or the largest power of two leaving >= 512 blocks of
    the budget (so a sample's finish is placed within 1/512 of the budget)."""
    if sim.token_block:
        return sim.token_block
    block = 1
    while cfg.sampling.max_response_len // (2 * block) >= 512:
        block *= 2
    return block


def length_model(sim: SimulateConfig) -> LengthModel:
    flat, rows = load_lengths_file(sim.length_file) if sim.length_file else ([], {})
    return LengthModel(sim.length_family, sim.length_median, sim.length_sigma, sim.group_correlation, sim.seed,
                       histogram=flat, rows=rows, alpha=sim.length_alpha)


def gpu_setting(cfg: Config, sim: SimulateConfig, gpus: int) -> Setting:
    tp = max(1, cfg.placement.engine_gpus)
    if gpus % tp:
        raise ConfigError(f"--gpus {gpus}: not a multiple of placement.engine_gpus={tp} (GPUs per engine)")
    model, acc = model_spec(cfg.model.path), ACCELERATORS[sim.accelerator]
    block = token_block(cfg, sim)
    cost = gpu_step_cost(model, acc, tp, sim.step_overhead_s, sim.bandwidth_efficiency, sim.flops_efficiency)
    kv = kv_capacity_tokens(model, acc, tp, cfg.engine.mem_fraction)
    workload = Workload(length_model(sim), [sim.prompt_len] * sim.num_prompts, block, cfg.sampling.max_response_len,
                        sim.filtered_fraction, sim.seed)
    stale = cfg.staleness.kv_max_versions(cfg.engine.reuse_stale_kv)
    return Setting(workload, cost, gpus // tp, cfg.engine.max_num_seqs, kv // block,
                   max(1, cfg.engine.max_prefill_tokens // block), cfg.staleness, cfg.engine.park_slots, stale,
                   sim.seed)


def batch_for(cfg: Config, engines: int) -> int:
    return max(1, round(cfg.rollout.rollout_batch_size * engines / cfg.engine.num_engines))


SCHEDULES = ("sync", "april", "oversample")
"""The synchronous baseline (N in flight); APRIL at N'; the over-provisioned baseline at N' (slime's rollout
without partial rollout, the APRIL paper's baseline: what is unfinished at the N-th group is discarded)."""


def rollout_for(cfg: Config, n: int, factor: float | None, schedule: str | None = None):
    """The monitor's section for N groups: `schedule` at N' = factor x N (sync: N); by default sync when
    `factor` is None, else APRIL."""
    schedule = schedule or ("sync" if factor is None else "april")
    assert schedule in SCHEDULES, schedule
    assert factor is not None or schedule == "sync", f"the {schedule} schedule needs an N'/N factor"
    scale = n / cfg.rollout.rollout_batch_size
    filtered = max(cfg.rollout.max_filtered_groups, round(cfg.rollout.max_filtered_groups * scale))
    over = n if schedule == "sync" else over_sampling_batch_size(factor, n)
    return dataclasses.replace(cfg.rollout, rollout_batch_size=n, over_sampling_batch_size=over,
                               schedule=schedule, max_filtered_groups=filtered)


def warmup_steps(schedule: str, sim: SimulateConfig) -> int:
    """Only APRIL carries unfinished work from one step to the next (the store): the baselines need no warm-up."""
    return sim.warmup_steps if schedule == "april" else 0


def run_schedule(setting: Setting, rollout, steps: int, warmup: int, clock: str, ceiling: float) -> dict:
    """One schedule on a fresh virtual loop. `clock`: what passes on the virtual clock besides the
    engines' steps: latency (the monitor's CPU), shared (the monitor's and everything else's but the
    simulated engines' own, holding the engines up: one thread for all) or none."""
    assert clock in ("latency", "shared", "none"), clock

    async def main(loop: VirtualLoop) -> dict:
        if clock != "none":
            loop.clocked.add(CONTROL_PLANE)
        if clock == "shared":
            loop.default_account, loop.stall = OTHER, True
            loop.clocked.add(OTHER)
        t0 = time.process_time()
        sched = Schedule(rollout.schedule, setting, rollout, loop)
        await sched.run(steps, warmup)
        return sched.summary(ceiling) | {"sim_cpu_s": time.process_time() - t0,
                                         "rollout_batch_size": rollout.rollout_batch_size,
                                         "over_sampling_batch_size": rollout.over_sampling_batch_size}

    return run_virtual(main)


def ceiling_of(setting: Setting, n_samples: int) -> float:
    """Blocks per second of one engine kept full at its cap (all engines of a setting are alike)."""

    async def main(loop: VirtualLoop) -> float:
        return await saturated(dataclasses.replace(setting, num_engines=1), loop, n_samples)

    return run_virtual(main)


def learner_s(cfg: Config, sim: SimulateConfig, gpus: int, tokens: float) -> float:
    """tokens x 6 x params / (learner GPUs x peak FLOP/s x MFU): colocated, the learner has every GPU;
    disaggregated, its ranks scale with the engines from the config's (learner.num_ranks x learner.gpus)."""
    learner_gpus = gpus if cfg.placement.colocate else max(1, round(
        cfg.learner.num_ranks * max(1, cfg.learner.gpus) * gpus / (cfg.engine.num_engines * max(1, cfg.placement.engine_gpus))))
    return learner_s_on(cfg, sim, learner_gpus, tokens)


def learner_s_on(cfg: Config, sim: SimulateConfig, learner_gpus: int, tokens: float) -> float:
    """tokens x 6 x params / (learner_gpus x peak FLOP/s x MFU): the learner's time on a given number of GPUs."""
    model, acc = model_spec(cfg.model.path), ACCELERATORS[sim.accelerator]
    return tokens * 6 * model.num_params / (learner_gpus * acc.flops * sim.learner_mfu)


def end_to_end_tok_s(rollout_tok_s: float, rollout_s: float, learner_s: float, weight_sync_s: float) -> float:
    """Trained tokens per wall second of a synchronous job: a step's trained tokens (rollout_tok_s x
    rollout_s) over the whole step, rollout + learner + weight sync one after the other."""
    return rollout_tok_s * rollout_s / (rollout_s + learner_s + weight_sync_s)


def weight_sync_s(cfg: Config, sim: SimulateConfig) -> float:
    """The policy's bytes over one link (a pipelined broadcast reaches every engine in about that time)."""
    return model_spec(cfg.model.path).weight_bytes / (sim.weight_sync_gb_s * 1e9)


def assumptions(cfg: Config, sim: SimulateConfig, setting: Setting) -> dict:
    model, acc = model_spec(cfg.model.path), ACCELERATORS[sim.accelerator]
    tp = max(1, cfg.placement.engine_gpus)
    wl = setting.workload
    return {
        "model": dataclasses.asdict(model) | {"kv_bytes_per_token": model.kv_bytes_per_token,
                                             "weight_bytes": model.weight_bytes},
        "accelerator": dataclasses.asdict(acc),
        "engine": {"gpus_per_engine (placement.engine_gpus, TP)": tp, "max_num_seqs": cfg.engine.max_num_seqs,
                   "kv_capacity_tokens": setting.kv_capacity * wl.block,
                   "max_prefill_tokens_per_step": cfg.engine.max_prefill_tokens,
                   "park_slots": cfg.engine.park_slots,
                   "resume": "re-prefills prompt + earlier tokens" if not cfg.engine.park_slots else "parked caches"},
        "step_cost": {"decode": "t0 + max((weight_bytes + context x kv_bytes_per_token) / (bw x bandwidth_efficiency),"
                                " (2 x params x rows + 4 x layers x heads x head_dim x context) / (flops x flops_efficiency))",
                      "prefill": "tokens x 2 x params / (flops x eff) + causal pairs x 4 x layers x heads x head_dim / (flops x eff)",
                      "t0_s": sim.step_overhead_s, "bandwidth_efficiency": sim.bandwidth_efficiency,
                      "flops_efficiency": sim.flops_efficiency, "memory_fraction (engine.mem_fraction)": cfg.engine.mem_fraction,
                      "tensor_parallel": "weights, KV, bandwidth and FLOP/s split evenly; all-reduces not modelled"},
        "responses": {"family": sim.length_family, "median": sim.length_median, "sigma": sim.length_sigma,
                      "alpha": sim.length_alpha, "file": sim.length_file, "group_correlation": sim.group_correlation,
                      "max_response_len": cfg.sampling.max_response_len, "prompt_len": sim.prompt_len,
                      "mean_drawn_tokens_uncapped": wl.lengths.mean() if wl.lengths.family != "task" else None,
                      "token_block": wl.block,
                      "rewards": "not simulated: sample 0 of each group gets 1, the others 0, so the dynamic "
                                 f"filter keeps every group except the filtered_fraction={sim.filtered_fraction} "
                                 "of prompts whose samples all get 0"},
        "batch_scaling": f"N = {cfg.rollout.rollout_batch_size} x engines / {cfg.engine.num_engines} groups of "
                         f"{cfg.rollout.n_samples_per_prompt} (the config's groups per engine), N' = factor x N",
        "learner": {"formula": "train tokens (prompt + response) x 6 x params / (GPUs x peak flops x mfu)",
                    "mfu": sim.learner_mfu, "colocated": cfg.placement.colocate},
        "weight_sync": {"gb_s": sim.weight_sync_gb_s, "seconds": weight_sync_s(cfg, sim)},
        "step": "step_s = rollout + learner + weight sync, one after the other (the job is synchronous)",
        "overlap": "sim/overlap.py: the job's own loop with train.overlap on E engines: the real CompletionMonitor's "
                   "steps with keep_running (each returns at its N-th complete group, no abort, its other groups "
                   "go on into the next step), asked ahead as RolloutGroup.batch asks (train.overlap_ahead steps "
                   "beyond the one the learner trains, each trained at its version), "
                   "N' in flight while a step collects (N and N' those of the G-GPU job, so each of the E engines "
                   "carries G/E times the config's load); the learner on the other G - E GPUs (learner formula on "
                   "G - E GPUs) trains each batch, spends one weight sync, and publishes the next version, which "
                   "the engines adopt at their next step boundary; each update costs the engines a pause as long "
                   "as the weight sync (charged as lost tokens when they set the pace); tokens older than "
                   "max_versions are masked at training; the last step drains (the run's one abort); splits: the "
                   "learner gets 1/2, 3/8, 1/4, 3/16, 1/8, 1/16 of the GPUs (whole engines, at least one GPU each "
                   "side); the best split is the one with the most trained tokens per wall second",
        "control_plane": "the real CompletionMonitor, PromptSource and PartialRolloutStore on this machine's "
                         "core: their CPU (process time) is measured per step and passes on the virtual clock "
                         "(latency: completions that arrive meanwhile wait for the monitor), engines unaffected",
        "ceiling": "one engine kept full at max_num_seqs (and its KV cache) on the same length mix, x engines",
        "throughput": "response tokens of the returned groups per rollout second, less those the learner's "
                      f"staleness mask drops (older than {cfg.staleness.max_versions} versions; none under "
                      "staleness.policy=keep): utilization, speedup and tok/s count these",
        "staleness": {"max_versions": cfg.staleness.max_versions, "policy": cfg.staleness.policy},
        "steps": {"measured": sim.steps, "warmup (APRIL only; the baselines carry nothing over)": sim.warmup_steps},
    }
