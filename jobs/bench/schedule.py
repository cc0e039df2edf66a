"""The schedules alone: the synchronous baseline vs APRIL on one engine in this process, without Ray.

    python -m jobs.bench.schedule --json PATH [--steps 30] [--factors 1,1.5,2,3,auto] [--oversample] [--config YAML]
        [key=value ...]

The same logic as the Ray run (`CompletionMonitor`; `PromptSource`;
`PartialRolloutStore`; `EngineWorker` on the CPU engine), wired on one event loop by `april_ray.rollout.local`:
no serialization, no calls between processes, no control-plane process on the engine's core. One engine
carries one engine's share of the Ray run's load: N / E groups a step, N' / E in flight (E =
engine.num_engines). So this measures what each schedule gets out of the engine's batch curve, which
bounds what `jobs.bench.rollout` can reach with the same engine; the rest of the gap is transport and the
cores the control plane takes.

`--oversample` adds the over-provisioned baseline at each N'/N (`rollout.schedule=oversample`: N' groups start
each step, the unfinished ones are discarded at the N-th complete group; slime's rollout without partial
rollout). `auto` in `--factors` is APRIL with `rollout.over_sampling_batch_size=auto` (mode `april_auto`, no
oversample twin): every mode reports the N'/N it used (`over_sampling_factor`: mean and last over the
measured steps) and the share of its tokens the learner would mask as stale. Every mode has its own engine
(same weights and seed), source (same seed, so the same prompts) and store; the modes run interleaved step
by step, one at a time, so the machine's drift falls on all alike. Before
each round the weights are published again under the next policy version. The ceiling is bench_rollout's
probe (`EngineWorker.throughput_probe`: every slot busy with the training prompts the schedules start
with, each finished request replaced at once) on an engine of its own, before, every `--probe-every`
rounds (default: every round, as the machine's speed drifts by 10% and more within a run, and the ceiling
must average over the same minutes as the modes), and after.

Each utilization is given twice: in wall-clock time (`utilization`: effective tokens/s over the probe's
tokens/s) and in CPU time (`cpu_utilization`: the same with this process's CPU seconds in place of
seconds). Everything here runs on one thread, so on a quiet core the two agree; on a shared machine the
wall clock also counts the time other processes held the core, which falls unevenly on the modes and the
probes, and only the CPU figure compares with the simulator's costs (fitted on CPU time).

Every engine step (the modes' and the probes') is recorded as `jobs.simulate --calibrate` fits step
costs (`StepRecorder` in jobs/bench/steplog.py: its thread's CPU time and the batch it ran): the JSON's
`step_costs` holds the fit, each feature summed per mode, and the CPU outside steps, so the simulator
predicts this run with costs from the same minutes of the machine. The recording's own CPU, outside the
steps it times, falls on every mode and on the probe alike. `fit_by_gap` checks the fit against each mode's
steps grouped by the CPU the thread spent on other work just before them (and each bin's mean rows: the
bins are not of like batches).
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np

from jobs.bench.steplog import StepLog, StepRecorder, public
from jobs.common import parse, write_result
from april_ray.config import Config, ConfigError, over_sampling_batch_size, with_rollout
from april_ray.model import load_policy
from april_ray.rollout.engine_worker import build_worker
from april_ray.rollout.local import LocalPool, LocalProxy
from april_ray.rollout.monitor import CompletionMonitor
from april_ray.rollout.prompt_source import PromptSource, first_prompts
from april_ray.rollout.store import PartialRolloutStore
from april_ray.task.data import read_examples
from driver.setup import JobInputs, prepare
from sim.calibrate import FEATURES, fit_by_gap, fit_costs


def per_engine(cfg: Config, factor: float | str | None) -> tuple[int, int | str]:
    """(N, N') for one engine: the Ray run's N / E, and N' = factor x that (the config's N' / E if None;
    auto stays auto)."""
    r, e = cfg.rollout, cfg.engine.num_engines
    if r.rollout_batch_size % e:
        raise ConfigError(f"rollout.rollout_batch_size={r.rollout_batch_size} does not split over "
                          f"engine.num_engines={e} engines")
    n = r.rollout_batch_size // e
    if factor == "auto" or (factor is None and r.over_sampling_batch_size == "auto"):
        return n, "auto"
    return n, over_sampling_batch_size(factor, n) if factor is not None else max(n, r.over_sampling_batch_size // e)


class LocalMode:
    """One schedule with its own engine, source and store, on this event loop."""

    def __init__(self, name: str, cfg: Config, model_path: str, train_examples, encode):
        self.name, self.cfg = name, cfg
        r = cfg.rollout
        self.worker = build_worker(cfg.engine, cfg.sampling, cfg.staleness, cfg.task, model_path)
        self.source = PromptSource(train_examples, encode, r.n_samples_per_prompt, cfg.sampling.max_response_len,
                                   cfg.task.seed)
        self.store = PartialRolloutStore(cfg.staleness)
        self.rollout = CompletionMonitor(r, LocalPool([self.worker], [cfg.engine.max_num_seqs]),
                                         LocalProxy(self.source), LocalProxy(self.store), cfg.staleness)
        self.log = StepLog(r.n_samples_per_prompt)
        self.cpu_s = 0.0
        """The process's CPU over the measured steps: everything (engine, worker, monitor) is on this thread."""
        self.recorder = StepRecorder(self.worker.engine.engine)
        """Every engine step's features and CPU time, warm-up included (the simulator's step costs)."""
        self.process_s = 0.0
        """The process's CPU over all its steps, warm-up included (what the recorder's steps add up to)."""
        self.sample_lengths: dict[str, int] = {}
        """Response length of every sample returned, warm-up included (the simulator's calibration replays
        them: this mode's own draws, which set sync's pace through each round's longest sample)."""

    async def step(self, step: int, measured: bool) -> None:
        before = self.worker.stats(drain=True)
        t0, c0 = time.perf_counter(), time.process_time()
        result = await self.rollout.step(step, step)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        self.recorder.boundary()
        self.process_s += dc
        after = self.worker.stats(drain=True)
        for meta in (m for group in result.metas for m in group):
            self.sample_lengths[meta.sample_id] = meta.response_len
        if measured:
            self.log.add(dt, result, len(self.store), [before], [after])
            self.cpu_s += dc

    def result(self, ceiling: float, cpu_ceiling: float) -> dict:
        r = self.rollout
        unaccounted = self.source.num_groups_taken - r.num_returned_groups - r.num_dropped_groups - len(self.store)
        res = self.log.summary(1, unaccounted)
        cpu_tok_s = res["trained_tokens"] / self.cpu_s
        return {"rollout_batch_size": self.cfg.rollout.rollout_batch_size,
                "over_sampling_batch_size": self.cfg.rollout.over_sampling_batch_size,
                **res, "utilization": res["effective_tok_s"] / ceiling,
                "cpu_s": self.cpu_s, "cpu_effective_tok_s": cpu_tok_s, "cpu_utilization": cpu_tok_s / cpu_ceiling,
                # what the learner trains: the tokens it masks as stale (staleness.policy=mask) left out
                "unmasked_utilization": res["effective_tok_s"] / ceiling * (1 - res["masked_token_ratio"]),
                "cpu_unmasked_utilization": cpu_tok_s / cpu_ceiling * (1 - res["masked_token_ratio"]),
                "sample_lengths": self.sample_lengths}


async def run(cfg: Config, args, job: JobInputs) -> dict:
    StepRecorder.new_run()
    model_path = job.model_path
    model, tok = load_policy(model_path)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    train = read_examples(job.train_path, cfg.task.prompt_key, cfg.task.answer_key)
    probe_prompts = first_prompts(train, tok.encode, cfg.task.seed, 512)
    n, _ = per_engine(cfg, None)
    factors = [f if f == "auto" else float(f) for f in args.factors.split(",")]
    modes = [LocalMode("sync", with_rollout(cfg, schedule="sync", rollout_batch_size=n,
                                            over_sampling_batch_size=n), model_path, train, tok.encode)]
    for f in factors:
        _, n_prime = per_engine(cfg, f)
        label = f if f == "auto" else f"{f:g}"
        modes.append(LocalMode(f"april_{label}", with_rollout(cfg, schedule="april", rollout_batch_size=n,
                                                              over_sampling_batch_size=n_prime),
                               model_path, train, tok.encode))
        if args.oversample and f != "auto":  # the over-provisioned baseline at the same (fixed) N'
            modes.append(LocalMode(f"oversample_{label}", with_rollout(cfg, schedule="oversample",
                                                                       rollout_batch_size=n, over_sampling_batch_size=n_prime),
                                   model_path, train, tok.encode))
    prober = build_worker(cfg.engine, cfg.sampling, cfg.staleness, cfg.task, model_path)
    probe_recorder = StepRecorder(prober.engine.engine)
    ceilings, cpu_ceilings, probe_process = [], [], [0.0]

    async def probe() -> None:
        c0 = time.process_time()
        tokens, seconds, cpu = await prober.throughput_probe(probe_prompts, cfg.engine.max_num_seqs,
                                                             args.probe_seconds)
        probe_process[0] += time.process_time() - c0
        probe_recorder.boundary()
        ceilings.append(tokens / seconds)
        cpu_ceilings.append(tokens / cpu)

    await probe()
    for step in range(args.warmup_steps + args.steps):
        for mode in modes:  # a stand-in learner publishes the weights under version `step`
            mode.worker.update_weights(state, step)
            await mode.step(step, measured=step >= args.warmup_steps)
        done = step + 1 - args.warmup_steps
        if 0 < done < args.steps and done % args.probe_every == 0:
            await probe()
    await probe()
    ceiling, cpu_ceiling = float(np.mean(ceilings)), float(np.mean(cpu_ceilings))
    results = {m.name: public(m.result(ceiling, cpu_ceiling)) for m in modes}
    sync = results["sync"]["effective_tok_s"]
    for name, res in results.items():
        res["speedup"] = res["effective_tok_s"] / sync
    return {"saturated_tok_s": ceiling, "saturated_runs": ceilings, "saturated_cpu_tok_s": cpu_ceiling,
            "saturated_cpu_runs": cpu_ceilings, **results,
            "step_costs": step_costs(modes, probe_recorder, probe_process[0]),
            "config": {"rollout_batch_size": n, "n_samples_per_prompt": cfg.rollout.n_samples_per_prompt,
                       "max_num_seqs": cfg.engine.max_num_seqs, "max_response_len": cfg.sampling.max_response_len,
                       "park_slots": cfg.engine.park_slots, "reuse_stale_kv": cfg.engine.reuse_stale_kv,
                       "max_staleness": cfg.staleness.max_versions, "factors": factors, "oversample": args.oversample,
                       "probe_seconds": args.probe_seconds, "probe_every": args.probe_every}}


def step_costs(modes: list[LocalMode], probe: StepRecorder, probe_process_s: float) -> dict:
    """The cost fit of every engine step of this run (the modes' and the probes'), each feature summed per
    mode, and the CPU between steps: the step costs `jobs.simulate --calibrate` simulates this run with, from the same minutes of
    the machine as the utilizations they are compared with (sim/calibrate.py)."""
    recorded = {m.name: m.recorder.rows for m in modes} | {"probe": probe.rows}
    gaps = {m.name: m.recorder.gaps for m in modes} | {"probe": probe.gaps}
    rows = [row for steps in recorded.values() for row in steps]
    by_mode = {m.name: m.recorder.between(m.process_s) for m in modes}
    by_mode["probe"] = probe.between(probe_process_s, boundary_apart=False)
    aborted = sum(m.recorder.aborted for m in modes)
    fit = fit_costs(rows)
    return {"fit": fit, "features": FEATURES + ("cpu_s",), "fit_by_gap": fit_by_gap(fit, recorded, gaps),
            "between_steps": {"boundary_per_aborted": sum(m.recorder.boundary_s for m in modes) / max(1, aborted),
                              "by_mode": by_mode},
            "sums": {name: dict(zip(FEATURES + ("cpu_s",), map(float, np.sum(steps, axis=0))))
                     for name, steps in recorded.items() if steps}}


def main() -> None:
    def extra(p):
        p.set_defaults(config=str(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"))
        p.add_argument("--json", required=True)
        p.add_argument("--steps", type=int, default=20)
        p.add_argument("--warmup-steps", type=int, default=2)
        p.add_argument("--factors", default="1.5",
                       help="APRIL's N'/N, comma-separated: one mode each; auto adapts it (april_auto)")
        p.add_argument("--oversample", action="store_true",
                       help="also the over-provisioned baseline (rollout.schedule=oversample) at each N'/N")
        p.add_argument("--probe-every", type=int, default=1, help="measure the ceiling every this many rounds")
        p.add_argument("--probe-seconds", type=float, default=2.0)

    cfg, args = parse(__doc__, extra)
    try:
        per_engine(cfg, None)
    except ConfigError as e:
        raise SystemExit(f"jobs.bench.schedule: {e}")
    result = asyncio.run(run(cfg, args, prepare(cfg)))
    write_result(args.json, result)


if __name__ == "__main__":
    main()
