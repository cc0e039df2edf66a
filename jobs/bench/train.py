"""Training benchmark: the synchronous baseline, APRIL (at one or several N'/N) and the overlapped mode
over several seeds.

    python -m jobs.bench.train --config configs/tiny_cpu.yaml --seeds K --json PATH [--modes sync,april,overlap]
        [--factors 1,1.5,2,3,auto] [--target ACC | --gain G] [--budgets S1,S2,...] [--first-seed S]
        [--reuse EARLIER_JSON ...] [--overlap-ahead K1,K2,... --corrections C1,C2,...] [key=value ...]

`--modes` (default sync,april): `sync` (N' = N, no partial rollouts), `april` (APRIL as configured) and
`overlap` (APRIL as configured with train.overlap=true: the learner trains while the engines go on
generating); `--factors` adds APRIL at each N'/N. For each seed the modes' jobs run one after the other
(round-robin by seed: every mode in that order, then the next seed), so a machine whose load drifts slows
every mode alike. A seed sets
`train.seed` (learner, prompt order) and `engine.seed` (sampling); the data and the warm-up model stay.
Times are training wall time (rollout + learner + weight sync; evaluation excluded). Per mode it reports
the median and range over seeds of: time to the target accuracy (a seed that never reaches it counts its
whole wall), held-out accuracy at wall-clock budgets and at each evaluated step, final accuracy (sampled
and greedy), late accuracy (the mean over the evaluations in the run's last third: one evaluation's
sampling noise and the policy's swing from one evaluation to the next average out), the off-policy token
ratio, the share of tokens masked as stale, staleness (mean, max, histogram), the step's phase times and
the N'/N used (`--factors auto`: the adaptive N', mode `april_auto`; each run's mean and last factor are
in its record), the engines' and the learner's idle shares of the job's wall time, and the CPU seconds
per step of the engines' processes, the learner's and the rest of the job (`jobs/bench/cpu.py`), with
the step time they imply at the least on this machine's cores (`floor_s`). `speedup`, `speedup_<factor>`
and `speedup_overlap` are sync's median time to target over the mode's; `overlap_over_april` is APRIL's
over the overlapped mode's.
The target defaults to the mean accuracy before training plus `--gain`; `eval_standard_error` is one
evaluation's sampling noise at that accuracy, sqrt(p (1 - p) / task.num_eval).

`--reuse` takes the runs of an earlier result of the same command (same config and overrides) instead of
running them again, by mode and seed: adding the factors to an earlier sync-vs-APRIL result runs only the
new modes. It may be given several times (results of other seeds or cells); a mode and seed found in two of
them stops the bench naming both. Each reused JSON's `config` must match this one's, or the bench stops and
names the first key that differs.

`--overlap-ahead` and `--corrections` turn the overlapped mode into a grid (`jobs/bench/grid.py`): one mode
`overlap_<k>_<correction>` per steps ahead and correction, run for every seed beside sync's one run; the
result's `grid` holds each cell's late accuracy (mean, sd, range), its paired difference to sync's in
points, steps/s over sync's, masked shares and train-inference mismatch by token age. The result so far is
written after each run, so a bench stopped early keeps its finished runs (`--reuse` goes on from them).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import time
from pathlib import Path

from april_ray.config import over_sampling_batch_size, validate, with_rollout
from april_ray.placement import plan
from driver.cluster import init_ray
from driver.train import train
from jobs.bench.cpu import JobCpu, per_step, training_windows
from jobs.bench.grid import grid_configs, grid_report, grid_table, mismatch_record, parse_grid
from jobs.common import parse, write_result


def time_to(history: list[tuple[float, float]], target: float) -> float | None:
    return next((t for t, acc in history if acc >= target), None)


def accuracy_at(history: list[tuple[float, float]], budget_s: float) -> float:
    """The last evaluation taken within `budget_s` of training time."""
    return [acc for t, acc in history if t <= budget_s][-1]


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def n_prime(factor: float | str, n: int) -> int | str:
    """N' for an N'/N factor (auto stays auto)."""
    return factor if factor == "auto" else over_sampling_batch_size(factor, n)


def mode_name(factor: float | str) -> str:
    return f"april_{factor}" if factor == "auto" else f"april_{factor:g}"


MODES = ("sync", "april", "overlap")


def parse_modes(text: str) -> list[str]:
    modes = [m for m in text.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise SystemExit(f"--modes: {','.join(unknown) or 'none given'}: expected a comma list of {', '.join(MODES)}")
    return modes


def mode_configs(cfg, factors: list[float | str], modes: list[str] = ("sync", "april")) -> dict[str, object]:
    """The modes asked, in order: sync (N' = N, no partial rollouts), APRIL as configured, the overlapped
    mode (APRIL as configured with train.overlap=true); then APRIL at N' = factor x N per factor (auto: the
    adaptive N')."""
    n = cfg.rollout.rollout_batch_size
    april = with_rollout(cfg, schedule="april")
    made = {"sync": lambda: with_rollout(cfg, schedule="sync", over_sampling_batch_size=n),
            "april": lambda: april,
            "overlap": lambda: validate(dataclasses.replace(april, train=dataclasses.replace(april.train,
                                                                                            overlap=True)))}
    configs = {m: made[m]() for m in modes}
    for f in factors:
        if n_prime(f, n) != cfg.rollout.over_sampling_batch_size or "april" not in configs:  # else `april`'s run
            configs[mode_name(f)] = with_rollout(cfg, schedule="april", over_sampling_batch_size=n_prime(f, n))
    return configs


def configured_factor(cfg, factors: list[float | str]) -> str | None:
    """The `april_<factor>` key that names APRIL as configured, when --factors lists its N'/N."""
    n = cfg.rollout.rollout_batch_size
    return next((mode_name(f) for f in factors if n_prime(f, n) == cfg.rollout.over_sampling_batch_size), None)


def seeded(cfg, mode: str, seed: int, base: Path):
    return dataclasses.replace(
        cfg, engine=dataclasses.replace(cfg.engine, seed=cfg.engine.seed + seed),
        train=dataclasses.replace(cfg.train, seed=seed, resume=False, output_dir=str(base / mode / f"seed{seed}")))


def reused_runs(paths: str | list[str], config: dict) -> dict[tuple[str, int], dict]:
    """(mode, seed) -> run record, from earlier results made with the same config (a path or several)."""
    return {key: rec for key, (_, rec) in reused_sources(paths, config).items()}


def reused_sources(paths: str | list[str], config: dict) -> dict[tuple[str, int], tuple[str, dict]]:
    """(mode, seed) -> (the result's path, run record), as `reused_runs`."""
    found: dict[tuple[str, int], tuple[str, dict]] = {}
    for path in [paths] if isinstance(paths, str) else paths:
        old = json.loads(Path(path).read_text())
        mine, theirs = flatten(config), flatten(old.get("config", {}))
        diff = next((k for k in sorted(mine.keys() | theirs.keys()) if mine.get(k) != theirs.get(k)), None)
        if diff is not None:
            raise SystemExit(f"--reuse {path}: made with another config ({diff}: {theirs.get(diff)!r} there, "
                             f"{mine.get(diff)!r} here)")
        for mode, m in old.items():
            if not (isinstance(m, dict) and "runs" in m):
                continue
            for seed, rec in zip(old["seeds"], m["runs"]):  # a mode's runs are its first seeds' (round-robin)
                if (mode, seed) in found:
                    raise SystemExit(f"--reuse: {mode} seed {seed} is in both {found[mode, seed][0]} and {path}")
                found[mode, seed] = (path, rec)
    return found


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out |= flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


def bench_config(cfg) -> dict:
    """What must match for runs to be comparable: the config without where each run writes."""
    c = dataclasses.asdict(cfg)
    c["train"] = {k: v for k, v in c["train"].items() if k not in ("output_dir", "resume")}
    return json.loads(json.dumps(c, default=str))


def run_record(summary: dict, eval_every: int, cpu: JobCpu | None = None, t0: float | None = None) -> dict:
    """What the bench keeps of one job: its summary, and per-step averages from its metrics.jsonl; with
    `cpu` (sampled while it ran) and `t0` (the perf_counter instant its training loop started), the CPU
    seconds per step of its roles in the training loop, evaluations excluded."""
    rows = [json.loads(line) for line in (Path(summary["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/version" in r]
    hist: dict[str, float] = {}
    for r in steps:
        for k, v in r.items():
            if k.startswith("rollout/staleness_hist/"):
                hist[k.rsplit("/", 1)[1]] = hist.get(k.rsplit("/", 1)[1], 0.0) + v / len(steps)
    evals = [r.get("eval/accuracy_greedy") for r in rows if "eval/accuracy_t1" in r]

    def mean(key):
        return sum(r.get(key, 0.0) for r in steps) / max(1, len(steps))

    eval_steps = [0] + [eval_every * (i + 1) for i in range(len(summary["history"]) - 2)] + [summary["steps"]]
    return {"history": summary["history"], "eval_steps": eval_steps, "train_s": summary["train_s"],
            "steps": summary["steps"], "accuracy_before": summary["accuracy_before"],
            "final_accuracy": summary["accuracy_after"], "final_accuracy_greedy": summary["accuracy_after_greedy"],
            "greedy_history": evals, "off_policy_token_ratio": mean("rollout/off_policy_token_ratio"),
            "staleness_mean": mean("rollout/staleness_mean"),
            "staleness_max": max((r.get("rollout/staleness_max", 0) for r in steps), default=0),
            "masked_token_ratio": mean("rollout/masked_token_ratio"),
            "over_sampling_factor": {"mean": mean("rollout/over_sampling_factor"),
                                     "last": steps[-1].get("rollout/over_sampling_factor", 0.0) if steps else 0.0},
            "staleness_hist": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
            "phase_s_per_step": {k: mean(f"time/{k}") for k in ("rollout_s", "learner_s", "weight_sync_s")},
            "rollout_share": rollout_share(summary["time_s"]),
            "engine_idle_fraction": summary["engine_idle_fraction"],
            "learner_idle_fraction": summary["learner_idle_fraction"]} | (
        {} if cpu is None else {"cpu_s_per_step": per_step(cpu.within(training_windows(steps, t0)), len(steps))}) | (
        mismatch_record(steps))


def late_accuracy(rec: dict) -> float:
    """Mean held-out accuracy over the evaluated steps in the last third of the run (several evaluations
    of one step averaged first); the last evaluation's if none falls there."""
    by_step: dict[int, list[float]] = {}
    for step, (_, acc) in zip(rec["eval_steps"], rec["history"]):
        if step > 0 and 3 * step >= 2 * rec["steps"]:
            by_step.setdefault(step, []).append(acc)
    return statistics.mean(statistics.mean(a) for a in by_step.values()) if by_step else rec["history"][-1][1]


def rollout_share(time_s: dict) -> float:
    """The rollout's share of the training time (rollout, learner, weight sync; evaluation excluded)."""
    return time_s["rollout_s"] / max(1e-9, time_s["rollout_s"] + time_s["learner_s"] + time_s["weight_sync_s"])


def summarize(runs: dict[str, list[dict]], target: float, budgets: list[float]) -> dict:
    """Per mode: the per-seed lists the JSON promises and their medians and ranges."""
    out = {}
    for mode, recs in runs.items():
        ttt = [time_to(r["history"], target) or r["train_s"] for r in recs]
        final = [r["final_accuracy"] for r in recs]
        by_step = {}
        for r in recs:
            for step, (_, acc) in zip(r["eval_steps"], r["history"]):
                by_step.setdefault(step, []).append(acc)
        out[mode] = {
            "time_to_target_s": ttt, "time_to_target_median_s": statistics.median(ttt),
            "time_to_target": spread(ttt),
            "reached_target": [time_to(r["history"], target) is not None for r in recs],
            "final_accuracy": final, "final_accuracy_median": statistics.median(final),
            "final_accuracy_range": spread(final),
            "final_accuracy_greedy": [r["final_accuracy_greedy"] for r in recs],
            "late_accuracy": [late_accuracy(r) for r in recs],
            "late_accuracy_median": statistics.median(late_accuracy(r) for r in recs),
            "late_accuracy_range": spread([late_accuracy(r) for r in recs]),
            "accuracy_at_budget": {f"{b:g}": spread([accuracy_at(r["history"], b) for r in recs]) for b in budgets},
            "accuracy_by_step": {str(s): statistics.median(a) for s, a in sorted(by_step.items())},
            "train_s": spread([r["train_s"] for r in recs]),
            "step_s": spread([r["train_s"] / max(1, r["steps"]) for r in recs]),
            "phase_s_per_step": {k: statistics.median(r["phase_s_per_step"][k] for r in recs)
                                 for k in recs[0]["phase_s_per_step"]},
            "rollout_share": spread([r["rollout_share"] for r in recs]),
            "off_policy_token_ratio": spread([r["off_policy_token_ratio"] for r in recs]),
            "staleness_mean": spread([r["staleness_mean"] for r in recs]),
            "staleness_max": max(r["staleness_max"] for r in recs),
            "masked_token_ratio": spread([r.get("masked_token_ratio", 0.0) for r in recs]),
            "over_sampling_factor_mean": spread([r.get("over_sampling_factor", {}).get("mean", 0.0) for r in recs]),
            "staleness_hist": {age: statistics.mean(r["staleness_hist"].get(age, 0.0) for r in recs)
                               for age in sorted({a for r in recs for a in r["staleness_hist"]}, key=int)},
            "runs": recs,
        }
        for key in ("engine_idle_fraction", "learner_idle_fraction"):  # runs reused from before lack them
            if all(key in r for r in recs):
                out[mode] |= {key: spread([r[key] for r in recs]), f"{key}s": [r[key] for r in recs]}
        if all("cpu_s_per_step" in r for r in recs):
            out[mode]["cpu_s_per_step"] = {k: spread([r["cpu_s_per_step"][k] for r in recs])
                                           for k in recs[0]["cpu_s_per_step"]}
    return out


def report(seeds: list[int], target: float, num_eval: int, runs: dict[str, list[dict]],
           budgets: list[float]) -> dict:
    result = {"seeds": seeds, "target_accuracy": target,
              "eval_standard_error": math.sqrt(target * (1 - target) / num_eval), "budgets_s": budgets}
    result |= summarize(runs, target, budgets)
    ttt = {mode: result[mode]["time_to_target_median_s"] for mode in runs}
    for mode in runs:
        if "sync" in runs and mode.startswith("april"):
            key = "speedup" if mode == "april" else f"speedup_{mode[len('april_'):]}"
            result[key] = ttt["sync"] / ttt[mode]
    if "overlap" in runs:
        if "sync" in runs:
            result["speedup_overlap"] = ttt["sync"] / ttt["overlap"]
        if "april" in runs:
            result["overlap_over_april"] = ttt["april"] / ttt["overlap"]
    return result


def table(result: dict) -> str:
    lines = ["| mode | time to target (s), median [min, max] | final acc., median [min, max] | late acc., median "
             "[min, max] | step (s) | rollout share | engine idle | learner idle | off-policy |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for mode, m in result.items():
        if isinstance(m, dict) and "time_to_target" in m:
            t, f, late = m["time_to_target"], m["final_accuracy_range"], m["late_accuracy_range"]
            lines.append(f"| {mode} | {t['median']:.0f} [{t['min']:.0f}, {t['max']:.0f}] | {f['median']:.3f} "
                         f"[{f['min']:.3f}, {f['max']:.3f}] | {late['median']:.3f} [{late['min']:.3f}, "
                         f"{late['max']:.3f}] | {m['step_s']['median']:.2f} | "
                         f"{m['rollout_share']['median']:.2f} | {median(m, 'engine_idle_fraction')} | "
                         f"{median(m, 'learner_idle_fraction')} | {m['off_policy_token_ratio']['median']:.2f} |")
    return "\n".join(lines)


def median(m: dict, key: str) -> str:
    return f"{m[key]['median']:.2f}" if key in m else "-"


def cpu_table(result: dict) -> str:
    """CPU seconds per step by role (medians over seeds) and the step time they allow at best on the cores."""
    lines = [f"| mode | step (s) | engines CPU-s/step | learner CPU-s/step | other CPU-s/step | floor on "
             f"{os.cpu_count()} cores (s) | whole machine CPU-s/step |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for mode, m in result.items():
        if isinstance(m, dict) and "cpu_s_per_step" in m:
            c = {k: v["median"] for k, v in m["cpu_s_per_step"].items()}
            lines.append(f"| {mode} | {m['step_s']['median']:.2f} | {c['engines']:.2f} | {c['learner']:.2f} | "
                         f"{c['other']:.2f} | {c['floor_s']:.2f} | {c['machine']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    def extra(p):
        p.add_argument("--json", required=True)
        p.add_argument("--seeds", type=int, default=3, help="K seeds from --first-seed, each runs every mode")
        p.add_argument("--first-seed", type=int, default=0, help="to add seeds to an earlier run's")
        p.add_argument("--modes", default="sync,april", help="comma list of sync, april, overlap")
        p.add_argument("--factors", default="", help="also APRIL at these N'/N, e.g. 1,1.5,2,3,auto")
        p.add_argument("--target", type=float, default=None, help="held-out accuracy to reach")
        p.add_argument("--gain", type=float, default=0.05, help="target = mean accuracy before + gain")
        p.add_argument("--budgets", default="", help="wall-clock budgets (s); default: quarters of sync's wall")
        p.add_argument("--reuse", action="append", default=[],
                       help="an earlier result's JSON, its runs (by mode and seed) not re-run; repeatable")
        p.add_argument("--overlap-ahead", default="", help="the overlapped mode at these train.overlap_ahead, e.g. 1,2,4")
        p.add_argument("--corrections", default="", help="... crossed with these algorithm.correction, e.g. tis,icepop")

    cfg, args = parse(__doc__, extra)
    factors = [f if f == "auto" else float(f) for f in args.factors.split(",") if f]
    modes = mode_configs(cfg, factors, parse_modes(args.modes))
    cells = {}
    if "overlap" in modes and (args.overlap_ahead or args.corrections):  # the overlapped mode becomes the grid
        cells = grid_configs(modes["overlap"], *parse_grid(args.overlap_ahead, args.corrections, cfg))
        modes = {k: v for m, c in modes.items() for k, v in (cells.items() if m == "overlap" else [(m, c)])}
    init_ray(plan(cfg))
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    reused = reused_sources(args.reuse, bench_config(cfg)) if args.reuse else {}
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for seed in seeds:  # round-robin: every mode's run for this seed before the next seed
        for mode, mode_cfg in modes.items():
            if (mode, seed) in reused:
                path, record = reused[mode, seed]
                runs[mode].append(record)
                print(f"seed {seed} {mode}: reused from {path}", flush=True)
                continue
            with JobCpu() as cpu:
                summary = train(seeded(mode_cfg, mode, seed, Path(cfg.train.output_dir)))
                t0 = time.perf_counter() - summary["wall_s"]  # the training loop's start
            runs[mode].append(run_record(summary, cfg.train.eval_every, cpu, t0))
            print(f"seed {seed} {mode}: train {summary['train_s']:.0f} s, accuracy "
                  f"{summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f}", flush=True)
            # the runs so far, kept should the bench stop: a mode's runs are its first seeds' (round-robin)
            partial = result_of(args, cfg, seeds[:seeds.index(seed) + 1], {m: r for m, r in runs.items() if r},
                                factors, cells, modes.get("sync"))
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(partial, indent=2, default=float))
    result = result_of(args, cfg, seeds, runs, factors, cells, modes.get("sync"))
    write_result(args.json, result)
    print(table(result))
    print(cpu_table(result))
    if cells:
        print(grid_table(result["grid"]))


def result_of(args, cfg, seeds: list[int], runs: dict[str, list[dict]], factors, cells: dict, sync_cfg) -> dict:
    """The report over `seeds` (and the grid's, with `cells`), with the config the runs were made with."""
    runs = dict(runs)
    if configured_factor(cfg, factors) and "april" in runs:
        runs[configured_factor(cfg, factors)] = runs["april"]
    before = [r["accuracy_before"] for recs in runs.values() for r in recs]
    target = args.target if args.target is not None else statistics.mean(before) + args.gain
    sync_wall = statistics.median(r["train_s"] for r in runs.get("sync") or next(iter(runs.values())))
    budgets = [float(b) for b in args.budgets.split(",") if b] or [round(sync_wall * q) for q in (0.25, 0.5, 0.75, 1)]
    result = report(seeds, target, cfg.task.num_eval, runs, budgets) | {"config": bench_config(cfg)}
    if cells:
        result["grid"] = grid_report(result, late_accuracy, cells, sync_cfg)
    return result


if __name__ == "__main__":
    main()
