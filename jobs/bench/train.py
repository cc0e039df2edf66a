"""Training benchmark: the synchronous baseline and APRIL, same seed and config, in one run.

    python -m jobs.bench.train --json PATH [--target ACC] [key=value ...]

Reports for each mode the training wall time (rollout + train + weight sync; evaluation excluded) until
held-out accuracy (temperature 1.0) first reaches the target, and the final accuracy. The target
defaults to the warm-up model's accuracy plus `--gain`.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from jobs.common import init_ray, parse, write_result
from april_ray.placement import plan
from jobs.train import train


def time_to(history: list[tuple[float, float]], target: float) -> float | None:
    return next((t for t, acc in history if acc >= target), None)


def main() -> None:
    def extra(p):
        p.add_argument("--json", required=True)
        p.add_argument("--target", type=float, default=None, help="held-out accuracy to reach")
        p.add_argument("--gain", type=float, default=0.05, help="target = accuracy before + gain")

    cfg, args = parse(__doc__, extra)
    init_ray(plan(cfg))
    base = Path(cfg.train.output_dir)
    runs = {}
    for mode, rollout in (("sync", {"partial_rollout": False,
                                    "over_sampling_batch_size": cfg.rollout.rollout_batch_size}),
                          ("april", {"partial_rollout": True})):
        mode_cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, **rollout),
                                       train=dataclasses.replace(cfg.train, output_dir=str(base / mode), resume=False))
        runs[mode] = train(mode_cfg)
    target = args.target if args.target is not None else runs["sync"]["accuracy_before"] + args.gain
    result = {"target_accuracy": target}
    for mode, s in runs.items():
        result[mode] = {"time_to_target_s": time_to(s["history"], target), "final_accuracy": s["accuracy_after"],
                        "accuracy_before": s["accuracy_before"], "train_s": s["train_s"], "history": s["history"]}
    t_sync, t_april = result["sync"]["time_to_target_s"], result["april"]["time_to_target_s"]
    result["speedup"] = t_sync / t_april if t_sync and t_april else None
    write_result(args.json, result)


if __name__ == "__main__":
    main()
