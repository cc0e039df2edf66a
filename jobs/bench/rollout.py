"""Rollout benchmark: the synchronous baseline vs APRIL on the same engines and data, in one run.

    python -m jobs.bench.rollout --json PATH [--sweep [--sweep-factors 1,1.5,2,3,4]] [--steps 10] [--config YAML]
        [key=value ...]

The config defaults to configs/tiny_cpu.yaml, the embedded default the main job trains with.

Per mode: a fresh prompt source's cursor (same seed, so the same prompts), an empty store and a monitor
of its own on the same engine actors; `--warmup-steps` unmeasured steps, then `--steps` measured ones.
The modes run interleaved, step by step, so that the machine's drift falls on all of them alike. Before each step a stand-in learner
publishes the weights again under the next policy version (through the real weight path), so versions
and staleness are exercised. Each sweep point runs interleaved with a sync baseline of its own. The
ceiling is the engines' saturated throughput measured in the same run, between the measured steps
(every `--probe-every` rounds, and before and after): every slot of every engine kept busy with this
task's prompts (each finished request replaced at once) for `--probe-seconds`, so the ceiling has the task's own
length mix but no tail and no interruption. Utilization is effective over the mean of the probes that
bracket a part of the run.

When the engines park interrupted samples' KV caches (engine.park_slots > 0, engine.reuse_stale_kv),
a third mode, `april_recompute`, runs APRIL again with reuse switched off on the same engines: every
resume re-prefills, as in slime and AReaL. `kv_reuse_speedup` is APRIL over it.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import ray

from actors.store import StoreActor
from jobs.bench.steplog import StepLog, public
from driver.cluster import init_ray
from jobs.common import parse, write_result
from sim.config import number_list
from april_ray.config import Config, over_sampling_batch_size, with_rollout
from april_ray.model import load_policy
from april_ray.task.data import read_examples
from driver.engines import EngineGroup
from driver.rollout import start_monitor, start_source
from driver.setup import JobInputs, prepare

def saturated_tok_s(engines: EngineGroup, prompts: list[list[int]], seconds: float) -> tuple[float, float]:
    """(tokens/s with every slot busy, the engine threads' CPU time over their step time meanwhile)."""
    before = engines.stats(drain=True)
    results = ray.get([e.throughput_probe.remote(prompts, cap, seconds)
                       for e, cap in zip(engines.actors, engines.capacities)])
    after = engines.stats(drain=True)
    return sum(t for t, _, _ in results) / max(s for _, s, _ in results), on_core(before, after)


def on_core(before, after) -> float:
    """Share of the engines' step time their threads were running (the rest, other processes had the core)."""
    busy = sum(a.busy_s - b.busy_s for a, b in zip(after, before))
    return sum(a.cpu_s - b.cpu_s for a, b in zip(after, before)) / busy if busy else 0.0


def set_kv_reuse(engines: EngineGroup, enabled: bool) -> None:
    ray.get([e.set_kv_reuse.remote(enabled) for e in engines.actors])


class Shared:
    """The actors the modes take turns on. One prompt source: a mode puts its cursor in before each of its
    steps and takes it back after, so it gets the prompts a source of its own would hand it (a source costs
    ~3 CPU-seconds to start, its tokenizer's imports; one per mode and sweep point was a third of a run's
    CPU). And the stores, each emptied before the next mode takes it up. Both are built as
    `RolloutGroup.start` builds them (driver/rollout.py), from no key of the rollout section: the only
    one the modes' configs differ in. Each mode's monitor is its own (`start_monitor`)."""

    def __init__(self, cfg: Config, job: JobInputs):
        self.source = start_source(cfg, job.model_path, job.train_path)
        self.fresh_cursor = ray.get(self.source.state_dict.remote())
        self.staleness = cfg.staleness
        self.free_stores: list = []
        self.empty_store: dict | None = None

    def store(self):
        if self.free_stores:
            return self.free_stores.pop()
        store = StoreActor.remote(self.staleness)
        if self.empty_store is None:
            self.empty_store = ray.get(store.state_dict.remote())  # a new store's: nothing stored
        return store

    def give_back(self, store) -> None:
        ray.get(store.load_state_dict.remote(self.empty_store))
        self.free_stores.append(store)


class Mode:
    """One rollout configuration with its own cursor, store and monitor on the shared engines."""

    def __init__(self, name: str, cfg: Config, shared: Shared, engines: EngineGroup, kv_reuse: bool = True):
        self.name, self.cfg, self.engines, self.kv_reuse, self.shared = name, cfg, engines, kv_reuse, shared
        self.cursor, self.store = shared.fresh_cursor, shared.store()
        self.monitor = start_monitor(cfg, engines, shared.source, self.store)
        self.log = StepLog(cfg.rollout.n_samples_per_prompt)

    def step(self, step: int, version: int, measured: bool) -> None:
        set_kv_reuse(self.engines, self.kv_reuse)
        ray.get(self.shared.source.load_state_dict.remote(self.cursor))
        before = self.engines.stats(drain=True)
        t0 = time.perf_counter()
        result = ray.get(self.monitor.step.remote(step, version))
        dt = time.perf_counter() - t0
        after = self.engines.stats(drain=True)
        self.cursor = ray.get(self.shared.source.state_dict.remote())
        if measured:
            self.log.add(dt, result, ray.get(self.store.size.remote()), before, after)

    def result(self) -> dict:
        taken = self.cursor["num_groups_taken"]
        counters = ray.get(self.monitor.state_dict.remote())
        stored = ray.get(self.store.size.remote())
        ray.kill(self.monitor)
        self.shared.give_back(self.store)
        unaccounted = taken - counters["returned_groups"] - counters["dropped_groups"] - stored
        return {**self.log.summary(len(self.engines.actors), unaccounted),
                "_occupancy": self.log.occupancy, "_lengths": self.log.lengths}


def run_interleaved(modes: list[Mode], engines: EngineGroup, weights_ref, steps: int, warmup_steps: int,
                    probe=None, probe_every: int = 0) -> dict:
    """Step i of every mode, one after the other, then step i + 1: the machine's drift over the run
    (its throughput moved by 20% within one run here) falls on every mode alike. Every mode's step i runs
    under policy version i, which a stand-in learner publishes through the real weight path. `probe()`
    runs every `probe_every` measured rounds (not after the last). Every mode's monitor and store are up
    before the first step (no step's time is an actor's start)."""
    ray.get([mode.monitor.state_dict.remote() for mode in modes] + [mode.store.size.remote() for mode in modes])
    for step in range(warmup_steps + steps):
        engines.publish(weights_ref, step)
        for mode in modes:
            mode.step(step, step, measured=step >= warmup_steps)
        done = step + 1 - warmup_steps
        if probe and probe_every and 0 < done < steps and done % probe_every == 0:
            probe()
    return {mode.name: mode.result() for mode in modes}


def plot(out_dir: Path, modes: dict[str, dict], cap: int) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for name, res in modes.items():
        steps = res["_occupancy"]
        num_engines = len(steps[0])
        fig, axes = plt.subplots(num_engines, 1, figsize=(11, 2.2 * num_engines), sharex=True, squeeze=False)
        # The modes ran interleaved: lay this mode's steps end to end.
        offsets, clock = [], 0.0
        for step in steps:
            times = [t for eng in step for t, _ in eng]
            offsets.append(clock - min(times) if times else 0.0)
            clock += (max(times) - min(times)) if times else 0.0
        for e in range(num_engines):
            ax = axes[e][0]
            for step, off in zip(steps, offsets):
                pts = step[e]
                if pts:
                    ax.step([t + off for t, _ in pts], [n for _, n in pts], where="post", lw=0.8, color="C0")
                    ax.axvline(pts[0][0] + off, color="0.8", lw=0.5)
            ax.axhline(cap, color="C3", ls="--", lw=0.8)
            ax.set_ylabel(f"engine {e}\nrunning")
            ax.set_ylim(0, cap * 1.1)
        axes[-1][0].set_xlabel("seconds of this mode's steps, end to end (grey: step starts; red: cap)")
        fig.suptitle(f"{name}: running-batch occupancy, effective {res['effective_tok_s']:.0f} tok/s, "
                     f"utilization {res['utilization']:.2f}")
        path = out_dir / f"occupancy_{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(str(path))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    lengths = np.array(modes["sync"]["_lengths"])
    ax.hist(lengths, bins=60, color="C0")
    ax.set_yscale("log")
    ax.set_xlabel("response length (tokens)")
    ax.set_title(f"response lengths (sync, n={len(lengths)}): median {np.median(lengths):.0f}, "
                 f"p99 {np.percentile(lengths, 99):.0f}, max {lengths.max()}")
    path = out_dir / "response_lengths.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return files + [str(path)]


def sweep(cfg: Config, shared: Shared, engines: EngineGroup, weights_ref, factors: list[float], steps: int,
          warmup_steps: int, ceiling_before: float, probe) -> dict:
    """The paper's ablation of the over-provisioning factor N'/N, at each of `factors`. Each point runs
    interleaved with a sync baseline of its own (every Ray actor costs ~1% of a core even idle, so the points
    do not all run at once); its speedup is over that baseline, its utilization over the probes before and
    after it."""
    n = cfg.rollout.rollout_batch_size
    keys = ("effective_tok_s", "off_policy_token_ratio", "max_staleness", "store_groups_mean",
            "abort_latency_ms_p99", "lost_samples", "duplicated_samples", "running_rows_mean", "boundary_ms",
            "engine_busy_fraction", "engine_on_core")
    out = {}
    for ratio in dict.fromkeys(factors):  # a factor given twice runs once
        modes = [Mode("sync", with_rollout(cfg, schedule="sync", over_sampling_batch_size=n), shared, engines),
                 Mode("april", with_rollout(cfg, schedule="april",
                                                over_sampling_batch_size=over_sampling_batch_size(ratio, n)),
                      shared, engines)]
        res = run_interleaved(modes, engines, weights_ref, steps, warmup_steps)
        sync, april = res["sync"], res["april"]
        ceiling_after = probe()
        out[f"{ratio:g}"] = {"speedup": april["effective_tok_s"] / sync["effective_tok_s"],
                             "utilization": april["effective_tok_s"] / np.mean([ceiling_before, ceiling_after]),
                             **{k: april[k] for k in keys}, "sync_effective_tok_s": sync["effective_tok_s"],
                             "sync_lost_samples": sync["lost_samples"],
                             "sync_duplicated_samples": sync["duplicated_samples"]}
        ceiling_before = ceiling_after
    return out


def main() -> None:
    parsers = []

    def extra(p):
        parsers.append(p)  # to name a bad --sweep-factors as the other flags are named
        p.set_defaults(config=str(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"))
        p.add_argument("--json", required=True)
        p.add_argument("--sweep", action="store_true", help="also run APRIL at each of --sweep-factors")
        p.add_argument("--sweep-factors", default="1,1.5,2,3,4",
                       help="the over-provisioning factors N'/N of the sweep, comma-separated, each at least 1")
        p.add_argument("--steps", type=int, default=10)
        p.add_argument("--warmup-steps", type=int, default=2)
        p.add_argument("--sweep-steps", type=int, default=6)
        p.add_argument("--probe-every", type=int, default=10, help="measure the ceiling every this many rounds")
        p.add_argument("--probe-seconds", type=float, default=8.0, help="length of one ceiling measurement")
        p.add_argument("--out-dir", default="outputs/bench_rollout")

    cfg, args = parse(__doc__, extra)
    factors = number_list(parsers[0], "--sweep-factors", args.sweep_factors, float, lambda f: f >= 1,
                          "N'/N of at least 1")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    job = prepare(cfg)
    init_ray(job.layout)
    engines = EngineGroup.start(cfg, job.model_path, job.layout)
    model, tok = load_policy(job.model_path)
    weights_ref = ray.put({k: v.clone() for k, v in model.state_dict().items()})
    probe_prompts = [tok.encode(ex.prompt) for ex in read_examples(job.eval_path)]

    saturated, probe_on_core = [], []

    def probe() -> float:
        tok_s, core = saturated_tok_s(engines, probe_prompts, args.probe_seconds)
        saturated.append(tok_s)
        probe_on_core.append(core)
        return tok_s

    probe()

    n = cfg.rollout.rollout_batch_size
    shared = Shared(cfg, job)
    modes = [Mode("sync", with_rollout(cfg, schedule="sync", over_sampling_batch_size=n), shared, engines),
             Mode("april", with_rollout(cfg, schedule="april"), shared, engines)]
    if cfg.engine.backend == "cpu" and cfg.engine.park_slots and cfg.engine.reuse_stale_kv:
        # Ablation in the same run: APRIL with every resume re-prefilled, as in slime and AReaL (the in-actor
        # engine's switch; an HTTP server has no such switch in SGLang's API).
        modes.append(Mode("april_recompute", with_rollout(cfg, schedule="april"), shared, engines,
                          kv_reuse=False))
    results = run_interleaved(modes, engines, weights_ref, args.steps, args.warmup_steps, probe, args.probe_every)
    probe()
    ceiling = float(np.mean(saturated))
    for res in results.values():
        res["utilization"] = res["effective_tok_s"] / ceiling
    result = {
        "saturated_tok_s": ceiling, "saturated_runs": saturated,
        "saturated_engine_on_core": float(np.mean(probe_on_core)),
        **{name: public(res) for name, res in results.items()},
        "speedup": results["april"]["effective_tok_s"] / results["sync"]["effective_tok_s"],
        **({"kv_reuse_speedup": results["april"]["effective_tok_s"] / results["april_recompute"]["effective_tok_s"]}
           if "april_recompute" in results else {}),
        "lost_samples": sum(res["lost_samples"] for res in results.values()),
        "duplicated_samples": sum(res["duplicated_samples"] for res in results.values()),
        "config": {"rollout_batch_size": n, "over_sampling_batch_size": cfg.rollout.over_sampling_batch_size,
                   "n_samples_per_prompt": cfg.rollout.n_samples_per_prompt,
                   "num_engines": cfg.engine.num_engines, "max_num_seqs": cfg.engine.max_num_seqs,
                   "max_response_len": cfg.sampling.max_response_len, "park_slots": cfg.engine.park_slots,
                   "reuse_stale_kv": cfg.engine.reuse_stale_kv, "max_staleness": cfg.staleness.max_versions},
        "plots": plot(out_dir, results, engines.capacities[0]),
    }
    if args.sweep:
        result["sweep"] = sweep(cfg, shared, engines, weights_ref, factors, args.sweep_steps,
                                args.warmup_steps, saturated[-1], probe)
        result["saturated_runs"] = saturated
    write_result(args.json, result)


if __name__ == "__main__":
    main()
