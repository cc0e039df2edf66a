"""What APRIL does on a GPU cluster we do not have: the real rollout scheduler in virtual time against
simulated engines (sim/), from a few GPUs to a thousand.

    python -m jobs.simulate --config configs/qwen3_4b_dapo.yaml --gpus 8,64,512,1024 [--factors 1,1.5,2,3,4]
        --json PATH [--plot PNG] [--workers N|auto] [key=value ...] [simulate.key=value ...]
    python -m jobs.simulate --config configs/tiny_cpu.yaml --measure-cpu docs/benchmarks/simulate_cpu.json
    python -m jobs.simulate --config configs/tiny_cpu.yaml --calibrate --json PATH

For each GPU count: the synchronous baseline (N groups in flight), and at each N'/N APRIL and the
over-provisioned baseline (slime's rollout without partial rollout, the APRIL paper's baseline: N' groups
start the step, the unfinished ones are discarded at the N-th complete group), with the completion
monitor, prompt source, partial-rollout store and engine workers of the training job, on engines whose
step costs follow the accelerator's roofline and whose responses end at lengths drawn from `simulate.length_*`
(sim/config.py; every constant is listed under `assumptions` in the JSON). The simulated engines
replace the configured backend (`engine.backend` and the server's settings are not used, except
`engine.mem_fraction`, the share of memory for weights and KV cache). Throughput, and with it
utilization and speedup, counts the response tokens the learner trains: those of the returned groups,
less those its staleness mask drops (`masked_token_ratio`; staleness.policy mask or restart); the
`sample_speedup`s compare samples per rollout second instead (every schedule returns N groups a step; the
over-provisioned baseline returns the N that finish first, the shortest). End to end, with the learner
and the weight sync in the step (`study.learner_s`, `study.weight_sync_s`), each row gives trained tokens
per wall second (`*_end_to_end_tok_s`) and their ratio to sync's (`april_end_to_end_speedup`,
`oversample_end_to_end_speedup`), and the overlapped mode's (sim/overlap.py: the job's own loop with
train.overlap, its steps kept running and asked ahead, on E of the G GPUs, the learner trains on the
rest, weights updated in flight) at each split of the GPUs
(`overlap_splits`) and at the best (`overlap_split`, `overlap_end_to_end_speedup`). Every schedule runs on its own
virtual loop, so `--workers N` runs them side by side in N processes (at most one per schedule), the
largest first: the same results (but for the measured control-plane CPU, which passes on the virtual
clock) in about the time of the longest schedule, given N free cores. The default, `auto`, is one process
per core this process may use (its CPU affinity, or its cgroup's CPU quota if lower); `--workers 1` runs
all in this process. `cpu_s` in the JSON counts every process's CPU, `wall_s` the command's wall-clock
time; the last line printed gives both.

`--measure-cpu` runs `jobs.bench.schedule` once (`--record-steps` rounds, default 24) for the CPU
engine's step costs, times a grid of uniform batches, and records the tiny model's response lengths.
`--calibrate` runs the simulator with those lengths and compares it with `jobs.bench.schedule`'s measured
utilizations (`--measured`, default docs/benchmarks/bench_schedule_calibration.json), with the step costs
of that bench run itself (those of `--cpu-costs` when it has none, and as a cross-check), and with the same
schedules' utilizations measured in `--cpu-costs`' own run ("in situ"), each in wall-clock and in CPU time
(the costs are CPU time; on a shared machine the wall clock also counts what other processes took of the
core). The simulated utilizations are given over the steady-state ceiling and over the bench's own probe
as it runs it, and, when the bench's JSON records its samples' lengths, with those lengths replayed.
"""
from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jobs.common import usable_cores, write_result
from april_ray.config import add_config_args, to_yaml
from sim import overlap, study
from sim.config import SimulateConfig, number_list, study_inputs

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"


def parse() -> tuple:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser)
    parser.add_argument("--gpus", default="8", help="GPU counts, comma-separated")
    parser.add_argument("--factors", default=None, help="APRIL's N'/N, comma-separated (default: the config's)")
    parser.add_argument("--json", default=None, help="where to write the results")
    parser.add_argument("--plot", default=None, help="PNG: utilization vs N'/N per GPU count")
    parser.add_argument("--workers", default="auto",
                        help="the GPU study: processes running its schedules side by side (default auto: one "
                             "per core this process may use)")
    parser.add_argument("--measure-cpu", default=None, metavar="PATH", help="measure the CPU engine, write PATH")
    parser.add_argument("--record-steps", type=int, default=24, help="--measure-cpu: the bench's rounds")
    parser.add_argument("--probe-seconds", type=float, default=2.0, help="--measure-cpu: the bench's probe window")
    parser.add_argument("--calibrate", action="store_true", help="simulate the CPU engine vs bench_schedule")
    parser.add_argument("--cpu-costs", default=str(DOCS / "simulate_cpu.json"), help="--measure-cpu's output")
    parser.add_argument("--measured", default=str(DOCS / "bench_schedule_calibration.json"),
                        help="jobs.bench.schedule's JSON: the utilizations to predict (and their step costs)")
    args = parser.parse_intermixed_args()
    if args.workers != "auto":
        try:
            args.workers = int(args.workers)
        except ValueError:
            parser.error(f"--workers {args.workers}: expected a number of processes or auto")
        if args.workers < 1:
            parser.error(f"--workers {args.workers}: must be at least 1")
        if args.workers > 1 and (args.calibrate or args.measure_cpu):
            parser.error("--workers runs the GPU study's schedules side by side; --calibrate and --measure-cpu run alone")
    cfg, sim = study_inputs(parser, args)
    if args.print_config:
        print(to_yaml(cfg))
        raise SystemExit(0)
    if cfg.rollout.over_sampling_batch_size == "auto" and not args.factors:
        parser.error("rollout.over_sampling_batch_size=auto: give --factors (the study compares fixed N'/N)")
    default = None if args.factors else cfg.rollout.over_sampling_batch_size / cfg.rollout.rollout_batch_size
    args.factors = number_list(parser, "--factors", args.factors, float, lambda f: 1 <= f < float("inf"),
                               "N'/N of at least 1") if args.factors else [default]
    return cfg, sim, args


def simulate_gpus(cfg, sim: SimulateConfig, gpus: list[int], factors: list[float], workers: int | str = 1) -> dict:
    """Every GPU count's synchronous baseline, and APRIL and the over-provisioned baseline at each factor,
    each schedule on its own virtual loop: with `workers` > 1 they run side by side in that many processes
    (`auto`: one per usable core; at most one per schedule either way; largest first), and each schedule's
    CPU figures are its own process's. The result's `workers` is the number of processes that ran them."""
    if workers == "auto":
        workers = usable_cores()
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers: expected a number of processes of at least 1 or 'auto', got {workers!r}")
    # every engine is alike, whatever their number
    ceiling = study.ceiling_of(study.gpu_setting(cfg, sim, gpus[0]), cfg.rollout.n_samples_per_prompt)
    # at N'/N = 1 the over-provisioned baseline is the synchronous one: not simulated twice
    tp = max(1, cfg.placement.engine_gpus)
    jobs = [job for g in gpus for job in [(g, None, "sync")]
            + [(g, f, k) for f in factors for k in ("april", "oversample") if k == "april" or f > 1]
            + [(g, f, f"overlap:{s['engines']}") for f in factors for s in overlap.splits(g, tp)]]
    workers = min(workers, len(jobs))  # (a process per schedule at most)
    pool = None
    if workers > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
        # the largest first (APRIL, with its warm-up, first among equals): the run ends about when its
        # longest schedule does
        futures = {job: pool.submit(run_one, cfg, sim, *job, ceiling)
                   for job in sorted(jobs, key=lambda j: (j[0], j[2] == "april"), reverse=True)}
    results, rows = {}, []
    try:
        for job in jobs:  # in order: a GPU count's rows as soon as its schedules are done
            results[job] = futures[job].result() if pool else run_one(cfg, sim, *job, ceiling)
            g, f, kind = job
            last = [j for j in jobs if j[0] == g and j[1] == f][-1]
            if kind == "sync" or job != last:
                continue  # a row once APRIL, its baseline and the overlapped splits are all in
            over = results[g, None, "sync"] | {"sim_cpu_s": 0.0} if f == 1 else results[g, f, "oversample"]
            april = results[g, f, "april"]
            splits = [results[j] for j in jobs if j[:2] == (g, f) and j[2].startswith("overlap:")]
            rows.append(result_row(cfg, sim, g, april["engines"], f, results[g, None, "sync"], april, over, splits))
            print(format_row(rows[-1]), flush=True)
    finally:
        if pool:  # on a failure, the schedules not started yet are dropped
            pool.shutdown(cancel_futures=True)
    setting = study.gpu_setting(cfg, sim, gpus[-1])
    return {"workers": workers, "ceiling_tok_s_per_engine": ceiling * setting.workload.block, "results": rows,
            "assumptions": study.assumptions(cfg, sim, setting),
            "control_plane_limit": control_plane_limit(rows, factors)}


def run_one(cfg, sim: SimulateConfig, gpus: int, factor: float | None, schedule: str, ceiling: float) -> dict:
    """One schedule (`study.SCHEDULES`) at one GPU count, at N'/N = factor (the synchronous baseline: N)."""
    if schedule.startswith("overlap:"):
        return run_overlap(cfg, sim, gpus, int(schedule.split(":")[1]), factor, ceiling)
    setting = study.gpu_setting(cfg, sim, gpus)
    n = study.batch_for(cfg, setting.num_engines)
    rollout = study.rollout_for(cfg, n, factor, schedule)
    return study.run_schedule(setting, rollout, sim.steps, study.warmup_steps(schedule, sim), "latency", ceiling) \
        | {"engines": setting.num_engines}


def run_overlap(cfg, sim: SimulateConfig, gpus: int, engine_gpus: int, factor: float, ceiling: float) -> dict:
    """The overlapped mode (sim/overlap.py) at G = `gpus`: engines on `engine_gpus` of them, the learner on
    the rest; the learner's batch is the N of G GPUs' engines (the algorithm's batch is that of the job at
    G), N' = factor x N in flight on the fewer engines."""
    tp = max(1, cfg.placement.engine_gpus)
    setting = study.gpu_setting(cfg, sim, engine_gpus)
    n = study.batch_for(cfg, gpus // tp)
    rollout = study.rollout_for(cfg, n, factor, "april")
    t0 = time.process_time()
    out = overlap.run_overlap(setting, rollout, n, rollout.over_sampling_batch_size, sim.warmup_steps + sim.steps,
                              sim.warmup_steps, study.learner_s_on(cfg, sim, gpus - engine_gpus, 1.0),
                              study.weight_sync_s(cfg, sim), ceiling, cfg.train.overlap_ahead)
    return out | {"engines": engine_gpus, "learner": gpus - engine_gpus, "sim_cpu_s": time.process_time() - t0}


def overlap_figures(splits: list[dict], sync_e2e_tok_s: float) -> dict:
    """Each split's trained tokens per wall second over sync's end to end, and the best split (the most
    tokens per second)."""
    per = [{"engines": s["engines"], "learner": s["learner"], "end_to_end_tok_s": s["tok_s"],
            "end_to_end_speedup": s["tok_s"] / sync_e2e_tok_s, "engine_utilization": s["utilization"],
            "learner_busy_fraction": s["learner_busy_fraction"], "period_s": s["period_s"],
            "pause_factor": s["pause_factor"], "masked_token_ratio": s["masked_token_ratio"],
            "off_policy_token_ratio": s["off_policy_token_ratio"], "staleness_hist": s["staleness_hist"],
            "staleness_mean": s["staleness_mean"], "staleness_max": s["staleness_max"],
            "engine_busy_fraction": s["engine_busy_fraction"], "batches_waiting_mean": s["batches_waiting_mean"],
            "sim_cpu_s": s["sim_cpu_s"]} for s in splits]
    if not per:
        return {"overlap_splits": []}
    best = max(per, key=lambda s: s["end_to_end_tok_s"])
    return {"overlap_end_to_end_speedup": best["end_to_end_speedup"],
            "overlap_split": {"engines": best["engines"], "learner": best["learner"]},
            "overlap_end_to_end_tok_s": best["end_to_end_tok_s"], "overlap_splits": per}


def result_row(cfg, sim, gpus: int, engines: int, factor: float, sync: dict, april: dict, over: dict,
               splits: list[dict] = ()) -> dict:
    learn = {k: study.learner_s(cfg, sim, gpus, r["train_tokens_per_step"])
             for k, r in (("sync", sync), ("april", april), ("over", over))}
    ws = study.weight_sync_s(cfg, sim)
    kv_bytes = study.model_spec(cfg.model.path).kv_bytes_per_token
    step_s = april["rollout_s"] + learn["april"] + ws
    sync_step_s, over_step_s = sync["rollout_s"] + learn["sync"] + ws, over["rollout_s"] + learn["over"] + ws
    e2e = {k: study.end_to_end_tok_s(r["unmasked_tok_s"], r["rollout_s"], learn[k], ws)
           for k, r in (("sync", sync), ("april", april), ("over", over))}
    return {
        "gpus": gpus, "engines": engines, "factor": factor,
        "rollout_batch_size": april["rollout_batch_size"], "over_sampling_batch_size": april["over_sampling_batch_size"],
        "sync_utilization": sync["unmasked_utilization"], "april_utilization": april["unmasked_utilization"],
        "speedup": april["unmasked_tok_s"] / sync["unmasked_tok_s"],
        "sync_tok_s": sync["unmasked_tok_s"], "april_tok_s": april["unmasked_tok_s"],
        "oversample_utilization": over["unmasked_utilization"], "oversample_tok_s": over["unmasked_tok_s"],
        "speedup_vs_oversample": april["unmasked_tok_s"] / over["unmasked_tok_s"],
        # every schedule returns N groups a step: samples per rollout second go as 1 / rollout time
        "sample_speedup": sync["rollout_s"] / april["rollout_s"],
        "sample_speedup_vs_oversample": over["rollout_s"] / april["rollout_s"],
        "oversample_generated_per_trained": over["generated_per_trained"],
        "off_policy_token_ratio": april["off_policy_token_ratio"], "staleness_hist": april["staleness_hist"],
        "masked_token_ratio": april["masked_token_ratio"],
        "step_s": step_s, "sync_step_s": sync_step_s, "step_speedup": sync_step_s / step_s,
        "oversample_step_s": over_step_s, "step_speedup_vs_oversample": over_step_s / step_s,
        # trained tokens per wall second, learner and weight sync included (the synchronous job's step)
        "sync_end_to_end_tok_s": e2e["sync"], "april_end_to_end_tok_s": e2e["april"],
        "oversample_end_to_end_tok_s": e2e["over"],
        "april_end_to_end_speedup": e2e["april"] / e2e["sync"],
        "oversample_end_to_end_speedup": e2e["over"] / e2e["sync"],
        **overlap_figures(list(splits), e2e["sync"]),
        "rollout_s": april["rollout_s"], "sync_rollout_s": sync["rollout_s"], "oversample_rollout_s": over["rollout_s"],
        "learner_s": learn["april"], "weight_sync_s": ws,
        "kv_peak_gb": max(april["kv_peak_tokens"], sync["kv_peak_tokens"], over["kv_peak_tokens"]) * kv_bytes / 1e9,
        "running_rows_mean": april["running_rows_mean"], "sync_running_rows_mean": sync["running_rows_mean"],
        "retractions": april["retractions"], "prefill_per_decoded": april["prefill_per_decoded"],
        "control_plane_cpu_s_per_step": april["control_plane_cpu_s_per_step"],
        "sync_control_plane_cpu_s_per_step": sync["control_plane_cpu_s_per_step"],
        "control_plane_share_of_rollout": april["control_plane_cpu_s_per_step"] / april["rollout_s"],
        "engine_side_cpu_s_per_step": april["engine_side_cpu_s_per_step"],
        "sample_calls_per_step": april["sample_calls_per_step"], "sync_sample_calls_per_step": sync["sample_calls_per_step"],
        "lost_groups": sum(r["lost_groups"] for r in (april, sync, over, *splits)),
        "duplicated_samples": sum(r["duplicated_samples"] for r in (april, sync, over, *splits)),
        "samples_with_wrong_length": sum(r["samples_with_wrong_length"] for r in (april, sync, over, *splits)),
        "sim_cpu_s": april["sim_cpu_s"] + sync["sim_cpu_s"] + over["sim_cpu_s"] + sum(s["sim_cpu_s"] for s in splits),
        "april_sim_cpu_s": april["sim_cpu_s"], "sync_sim_cpu_s": sync["sim_cpu_s"], "oversample_sim_cpu_s": over["sim_cpu_s"],
    }


def control_plane_limit(rows: list[dict], factors: list[float]) -> dict:
    """Per factor: the GPU count at which the monitor's CPU per step would reach the rollout's own time,
    extrapolated as a power law through the two largest measured counts (it must fit in the step: the
    monitor is one thread)."""
    out = {}
    for f in factors:
        pts = sorted((r["gpus"], r["control_plane_cpu_s_per_step"], r["rollout_s"]) for r in rows if r["factor"] == f)
        over = [g for g, cp, roll in pts if cp >= roll]
        if over:
            out[str(f)] = {"gpus": over[0], "how": "measured"}
        elif len(pts) >= 2 and pts[-1][1] > pts[-2][1] > 0:
            (g1, c1, _), (g2, c2, r2) = pts[-2], pts[-1]
            k = math.log(c2 / c1) / math.log(g2 / g1)
            out[str(f)] = {"gpus": round(g2 * (r2 / c2) ** (1 / k)), "exponent": k, "how": "extrapolated"}
    return out


def format_row(r: dict) -> str:
    return (f"gpus {r['gpus']:5d}  N'/N {r['factor']:<4g} sync {r['sync_utilization']:.3f}  APRIL "
            f"{r['april_utilization']:.3f}  speedup {r['speedup']:.2f}  off-policy {r['off_policy_token_ratio']:.2f}  "
            f"masked {r['masked_token_ratio']:.3f}  over-provisioned baseline {r['oversample_utilization']:.3f} "
            f"(APRIL x{r['speedup_vs_oversample']:.2f} tokens/s, x{r['sample_speedup_vs_oversample']:.2f} samples/s)  "
            f"step {r['step_s']:.0f} s (sync {r['sync_step_s']:.0f})  KV peak {r['kv_peak_gb']:.1f} GB  "
            f"control plane {r['control_plane_cpu_s_per_step']:.3f} s/step  [sim {r['sim_cpu_s']:.1f} s CPU]\n"
            f"    end to end vs sync: APRIL {r['april_end_to_end_speedup']:.2f}  over-provisioned "
            f"{r['oversample_end_to_end_speedup']:.2f}  overlapped "
            + "  ".join(f"{s['engines']}+{s['learner']} {s['end_to_end_speedup']:.2f}" for s in r["overlap_splits"])
            + (f"  (best {r['overlap_split']['engines']}+{r['overlap_split']['learner']})" if r["overlap_splits"] else ""))


def plot(rows: list[dict], path: str) -> None:
    """Left: utilization vs N'/N per GPU count (APRIL, the over-provisioned baseline, sync); right: the
    same against the GPU count, one line per schedule and factor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, by_gpus) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, g in enumerate(sorted({r["gpus"] for r in rows})):
        rs = sorted((r for r in rows if r["gpus"] == g), key=lambda r: r["factor"])
        line, = ax.plot([r["factor"] for r in rs], [r["april_utilization"] for r in rs], "o-", label=f"APRIL, {g} GPUs")
        ax.plot([r["factor"] for r in rs], [r["oversample_utilization"] for r in rs], "s--", color=line.get_color(),
                lw=1, ms=4, label=f"over-provisioned baseline, {g} GPUs")
        ax.axhline(rs[0]["sync_utilization"], color=line.get_color(), ls=":", lw=1,
                   label=f"sync, {g} GPUs")
    ax.set_xlabel("over-provisioning N'/N (APRIL and the over-provisioned baseline)")
    for f in sorted({r["factor"] for r in rows}):
        rs = sorted((r for r in rows if r["factor"] == f), key=lambda r: r["gpus"])
        gpus = [r["gpus"] for r in rs]
        line, = by_gpus.plot(gpus, [r["april_utilization"] for r in rs], "o-", label=f"APRIL, N'/N = {f:g}")
        by_gpus.plot(gpus, [r["oversample_utilization"] for r in rs], "s--", color=line.get_color(), lw=1, ms=4,
                     label=f"over-provisioned baseline, N'/N = {f:g}")
    rs = sorted({r["gpus"]: r for r in rows}.values(), key=lambda r: r["gpus"])
    by_gpus.plot([r["gpus"] for r in rs], [r["sync_utilization"] for r in rs], "k:", marker="^", lw=1, label="sync")
    by_gpus.set_xscale("log", base=2)
    by_gpus.set_xlabel("GPUs")
    for a in (ax, by_gpus):
        a.set_ylabel("utilization of the saturated ceiling")
        a.set_ylim(0, 1)
        a.grid(alpha=0.3)
        a.legend(fontsize=7, ncol=2 if a is ax else 1)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def public_schedules(schedules: dict) -> dict:
    """A bench result without its per-sample lengths and its step costs (kept once, at the top)."""
    return {k: ({kk: vv for kk, vv in v.items() if kk != "sample_lengths"} if isinstance(v, dict) else v)
            for k, v in schedules.items() if k != "step_costs"}


def bench_schedule(args) -> dict:
    """One run of `jobs.bench.schedule` (sync, APRIL at 1.5 and 3) on the job's config, in a process of its
    own as any entry point runs: its result, step costs included."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        config = ["--config", args.config] if args.config else []
        cmd = [sys.executable, "-m", "jobs.bench.schedule", *config, "--json", str(out), "--steps",
               str(args.record_steps), "--factors", "1.5,3", "--probe-seconds", str(args.probe_seconds),
               *(o for o in args.overrides if not o.startswith("simulate."))]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main() -> None:
    cfg, sim, args = parse()
    t0, c0 = time.time(), time.process_time()
    if args.measure_cpu:
        from sim.calibrate import measure

        schedules = bench_schedule(args)
        write_result(args.measure_cpu, measure(cfg, schedules) | {"schedules": public_schedules(schedules)})
        return
    if args.calibrate:
        from sim.calibrate import calibrate

        result = calibrate(cfg, sim, json.loads(Path(args.cpu_costs).read_text()),
                           json.loads(Path(args.measured).read_text()))
    else:
        result = simulate_gpus(cfg, sim, args.gpus, args.factors, args.workers)
        if args.plot:
            plot(result["results"], args.plot)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = {"wall_s": time.time() - t0, "cpu_s": time.process_time() - c0 + children.ru_utime + children.ru_stime,
              **result}
    write_result(args.json, result)
    if not args.calibrate:
        print(f"{result['wall_s']:.0f} s wall, {result['cpu_s']:.0f} s of CPU in {result['workers']} "
              f"process{'es' if result['workers'] > 1 else ''}", flush=True)


if __name__ == "__main__":
    main()
