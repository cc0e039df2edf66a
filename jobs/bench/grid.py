"""The overlapped mode's grid in the training benchmark (`jobs.bench.train --overlap-ahead 1,2,4 --corrections
tis,icepop,seq_mask_tis`): steps ahead (train.overlap_ahead) crossed with off-policy corrections
(algorithm.correction), each cell a mode run over the same seeds as sync, and per cell what the question "how
far ahead can the engines run, with which correction" needs: late accuracy against sync's (paired by seed), the
speed against sync's, what the staleness bound and the correction masked, and the train-inference mismatch by
token age (the learner's `mismatch/` keys)."""
from __future__ import annotations

import dataclasses
import math
import statistics

from april_ray.config import ConfigError, validate

MISMATCH_FIELDS = ("log_ratio_mean", "k1", "k2", "k3")
"""Means over every loss-mask token (weighted by `num_tokens`)."""
SHARES = ("tis_share", "icepop_share", "seq_mask_tis_share")
"""Shares of the trained tokens (weighted by `num_trained_tokens`)."""


def cell_name(ahead: int, correction: str) -> str:
    return f"overlap_{ahead}_{correction}"


def parse_grid(aheads: str, corrections: str, cfg) -> tuple[list[int], list[str]]:
    """The steps ahead and corrections asked (either list empty: the config's one)."""
    try:
        ks = [int(k) for k in aheads.split(",") if k] or [cfg.train.overlap_ahead]
    except ValueError:
        raise SystemExit(f"--overlap-ahead: {aheads!r}: expected a comma list of positive integers") from None
    if min(ks) < 1:
        raise SystemExit(f"--overlap-ahead: {aheads!r}: expected a comma list of positive integers")
    return ks, [c for c in corrections.split(",") if c] or [cfg.algorithm.correction]


def grid_configs(overlap_cfg, aheads: list[int], corrections: list[str]) -> dict[str, object]:
    """One overlapped config per (steps ahead, correction), ahead-major. A cell further ahead than
    staleness.max_versions raises the bound to its steps ahead (the config refuses less; policy keep has no
    bound); the others keep the config's."""
    cells = {}
    for k in aheads:
        staleness = overlap_cfg.staleness
        if staleness.policy != "keep" and staleness.max_versions < k:
            staleness = dataclasses.replace(staleness, max_versions=k)
        for c in corrections:
            try:
                cells[cell_name(k, c)] = validate(dataclasses.replace(
                    overlap_cfg, staleness=staleness,
                    train=dataclasses.replace(overlap_cfg.train, overlap_ahead=k),
                    algorithm=dataclasses.replace(overlap_cfg.algorithm, correction=c)))
            except ConfigError as e:
                raise SystemExit(f"--overlap-ahead/--corrections: cell {cell_name(k, c)}: {e}") from None
    return cells


def mismatch_record(steps: list[dict]) -> dict:
    """One run's train-inference mismatch from its step rows: over the run (`mismatch`) and by token age
    (`mismatch_by_age`, with each age's share of the loss-mask tokens), each key weighted by its tokens."""

    def weighted(prefix: str) -> dict[str, float]:
        tokens = sum(r.get(f"{prefix}num_tokens", 0.0) for r in steps)
        trained = sum(r.get(f"{prefix}num_trained_tokens", 0.0) for r in steps)
        out = {"num_tokens": tokens, "num_trained_tokens": trained}
        for keys, total, weight in ((MISMATCH_FIELDS, tokens, "num_tokens"), (SHARES, trained, "num_trained_tokens")):
            for k in keys:
                out[k] = sum(r.get(f"{prefix}{k}", 0.0) * r.get(f"{prefix}{weight}", 0.0)
                             for r in steps) / max(total, 1.0)
        out["log_ratio_rms"] = math.sqrt(2 * out["k2"])  # k2 = (log r)^2 / 2
        return out

    ages = sorted({int(k.split("/")[1][3:]) for r in steps for k in r if k.startswith("mismatch/age")})
    whole = weighted("mismatch/")
    by_age = {str(a): weighted(f"mismatch/age{a}/") for a in ages}
    for row in by_age.values():
        row["token_share"] = row["num_tokens"] / max(whole["num_tokens"], 1.0)
    return {"mismatch": whole, "mismatch_by_age": by_age}


def grid_report(result: dict, late_accuracy, cells: dict[str, object], sync_cfg) -> dict:
    """Per cell (and sync): late accuracy's mean, standard deviation and range over seeds, its paired
    difference to sync's in points, steps per second over sync's (the medians' ratio), the stale-token and
    the correction's masked shares and the mismatch; `best_by_ahead`: each steps-ahead's best correction by
    mean late accuracy."""
    sync = [late_accuracy(r) for r in result["sync"]["runs"]] if "sync" in result else None
    rows = {"sync": (0, sync_cfg)} if sync else {}
    rows |= {name: (cfg.train.overlap_ahead, cfg) for name, cfg in cells.items() if name in result}
    out = {}
    for name, (ahead, cfg) in rows.items():
        recs = result[name]["runs"]
        seen = [r for r in recs if "mismatch" in r]  # runs reused from before the mismatch keys lack them
        late = [late_accuracy(r) for r in recs]
        correction = cfg.algorithm.correction
        share = f"{correction}_share" if f"{correction}_share" in SHARES else None
        out[name] = {
            "ahead": ahead, "correction": correction, "max_versions": cfg.staleness.max_versions,
            "late_accuracy_mean": statistics.mean(late),
            "late_accuracy_sd": statistics.stdev(late) if len(late) > 1 else 0.0,
            "late_accuracy_range": [min(late), max(late)],
            "masked_token_ratio": statistics.mean(r.get("masked_token_ratio", 0.0) for r in recs),
            "correction_share": statistics.mean(r["mismatch"][share] for r in seen) if share and seen else 0.0,
            "mismatch": mean_of([r["mismatch"] for r in seen]),
            "mismatch_by_age": {a: mean_of([r["mismatch_by_age"][a] for r in seen if a in r["mismatch_by_age"]])
                                for a in sorted({a for r in seen for a in r["mismatch_by_age"]}, key=int)}}
        if sync:
            diffs = [100 * (x - s) for x, s in zip(late, sync)]
            out[name] |= {"late_minus_sync_points": statistics.mean(diffs), "late_minus_sync_points_per_seed": diffs,
                          "steps_per_s_over_sync": result["sync"]["step_s"]["median"] / result[name]["step_s"]["median"]}
    best = {}
    for k in sorted({c["ahead"] for n, c in out.items() if n != "sync"}):
        name = max((n for n, c in out.items() if n != "sync" and c["ahead"] == k),
                   key=lambda n: out[n]["late_accuracy_mean"])
        best[str(k)] = {"cell": name, "correction": out[name]["correction"],
                        "late_minus_sync_points": out[name].get("late_minus_sync_points")}
    return {"cells": out, "best_by_ahead": best}


def mean_of(dicts: list[dict]) -> dict[str, float]:
    return {k: statistics.mean(d[k] for d in dicts) for k in dicts[0]} if dicts else {}


def grid_table(grid: dict) -> str:
    lines = ["| mode | ahead | correction | late acc. mean ± sd [min, max] | vs sync (points) | steps/s vs sync | "
             "stale masked | correction masked/clipped | k3 | rms log r | log r by age 0 / 1 / 2 / 3 / 4 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, c in grid["cells"].items():
        lo, hi = c["late_accuracy_range"]
        by_age = " / ".join(f"{c['mismatch_by_age'][a]['log_ratio_mean']:+.3f}" if a in c["mismatch_by_age"] else "-"
                            for a in "01234")
        vs = f"{c['late_minus_sync_points']:+.1f}" if "late_minus_sync_points" in c else "-"
        speed = f"{c['steps_per_s_over_sync']:.2f}" if "steps_per_s_over_sync" in c else "-"
        lines.append(f"| {name} | {c['ahead']} | {c['correction']} | {c['late_accuracy_mean']:.3f} ± "
                     f"{c['late_accuracy_sd']:.3f} [{lo:.3f}, {hi:.3f}] | {vs} | {speed} | "
                     f"{c['masked_token_ratio']:.3f} | {c['correction_share']:.3f} | {c['mismatch'].get('k3', 0):.2e} | "
                     f"{c['mismatch'].get('log_ratio_rms', 0):.3f} | {by_age} |")
    return "\n".join(lines)
