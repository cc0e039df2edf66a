"""The curves of one or more runs from their `metrics.jsonl`, without a server: reward, held-out accuracy,
tokens/s, step time by phase, off-policy share and staleness, and the train-inference mismatch by token age
(when the rows have it), by step (left) and by wall time (right), one colour per run.

    python -m jobs.plot RUN_DIR [RUN_DIR ...] --png PATH

RUN_DIR is a job's `train.output_dir` (for example `outputs/train`, or `jobs.bench.train`'s
`<output_dir>/sync/seed0` and `<output_dir>/april/seed0` side by side); runs are named by their path below
the directories' common parent.
"""
from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

# (title, [(key, line style, label suffix)]): each key is drawn where a row has it
PANELS = [
    ("reward (trained batch)", [("train/reward_mean", "-", "")]),
    ("held-out accuracy", [("eval/accuracy_t1", "o-", " t=1"), ("eval/accuracy_greedy", "s--", " greedy")]),
    ("tokens/s (rollout)", [("rollout/effective_tok_s", "-", "")]),
    ("step time by phase (s)", [("time/rollout_s", "-", " rollout"), ("time/learner_s", "--", " learner"),
                                ("time/weight_sync_s", ":", " weight sync"), ("time/eval_s", "x", " eval")]),
    ("off-policy share of trained tokens", [("off_policy/token_ratio", "-", "")]),
    ("staleness (policy versions)", [("rollout/staleness_mean", "-", " mean"), ("rollout/staleness_max", ":", " max")]),
]


MISMATCH_AGE = re.compile(r"^mismatch/age(\d+)/")
AGE_STYLES = ["--", ":", "-.", ".-", "x--", "+:"]


def mismatch_panels(runs: list[tuple[str, list[dict]]]) -> list:
    """The learner's `mismatch/` curves: k3 and the mean log-ratio over every age and by each token age any run
    has (line styles cycle over the ages), and the share of trained tokens each correction masks or clips."""
    ages = sorted({int(m.group(1)) for _, rows in runs for r in rows for k in r if (m := MISMATCH_AGE.match(k))})
    if not ages:
        return []

    def by_age(field: str) -> list:
        return [(f"mismatch/{field}", "-", " all")] + [
            (f"mismatch/age{a}/{field}", AGE_STYLES[i % len(AGE_STYLES)], f" age {a}") for i, a in enumerate(ages)]

    return [("mismatch KL(rollout || learner), k3, by token age", by_age("k3")),
            ("mismatch: mean log(pi_learner / pi_rollout) by token age", by_age("log_ratio_mean")),
            ("trained tokens masked or clipped, all ages", [
                ("mismatch/tis_share", "-", " tis clips"), ("mismatch/icepop_share", "--", " icepop masks"),
                ("mismatch/seq_mask_tis_share", ":", " seq_mask_tis masks")])]


def read_rows(run_dir: Path) -> list[dict]:
    """The run's step rows; a torn last line (a run still writing, or killed) is left out."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{run_dir}: no metrics.jsonl (is it a job's train.output_dir?)")
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return [r for r in rows if isinstance(r, dict) and isinstance(r.get("step"), int)]


def run_names(run_dirs: list[Path]) -> list[str]:
    if len(run_dirs) == 1:
        return [run_dirs[0].resolve().name]
    parent = Path(os.path.commonpath([d.resolve() for d in run_dirs]))
    return [str(d.resolve().relative_to(parent)) or d.resolve().name for d in run_dirs]


def with_wall_time(rows: list[dict]) -> list[dict]:
    """Each row with `time/wall_s`; the final evaluation's row (after the last step) has none: the last
    step's is its time."""
    last, out = 0.0, []
    for r in rows:
        last = r.get("time/wall_s", last)
        out.append({**r, "time/wall_s": last})
    return out


def series(rows: list[dict], key: str, x_key: str) -> tuple[list[float], list[float]]:
    # a step's row counts from 1 (after step 0 trained, one step is done), as the job's progress line does
    pts = [((r["step"] + 1) if x_key == "step" else r[x_key] / 60, r[key]) for r in rows if key in r]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot(run_dirs: list[Path], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(name, with_wall_time(read_rows(d))) for name, d in zip(run_names(run_dirs), run_dirs)]
    panels = PANELS + mismatch_panels(runs)
    fig, axes = plt.subplots(len(panels), 2, figsize=(13, 3.1 * len(panels)), squeeze=False)
    for row, (title, keys) in enumerate(panels):
        for col, (x_key, x_label) in enumerate((("step", "step"), ("time/wall_s", "wall time (min)"))):
            ax = axes[row][col]
            for i, (name, rows) in enumerate(runs):
                for key, style, suffix in keys:
                    xs, ys = series(rows, key, x_key)
                    if xs:
                        ax.plot(xs, ys, style, color=f"C{i}", markersize=3, linewidth=1.2, label=f"{name}{suffix}")
            ax.set_title(title, fontsize=10)
            ax.set_xlabel(x_label, fontsize=9)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    fig.suptitle(" vs ".join(name for name, _ in runs), fontsize=11)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=90)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument("--png", type=Path, required=True)
    args = parser.parse_args()
    plot(args.run_dirs, args.png)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
