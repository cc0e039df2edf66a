"""Response lengths of a config's task: the right responses' token counts (EOS included) over its training
set, as percentiles, and a histogram beside other configs'.

    python -m jobs.bench.lengths --config configs/tiny_cpu_longtail.yaml [--compare configs/tiny_cpu.yaml ...]
        [--plot PNG] [--json PATH] [key=value ...]

The policy's own lengths follow these closely once it has warmed up (it learns when a countdown ends); the
rollout's are in each run's metrics (`rollout/response_len_mean`). `--compare` configs are read with their
own defaults only (overrides apply to `--config`).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from april_ray.config import Config, load_config
from april_ray.task.data import dataset_paths, read_examples
from april_ray.task.tokenizer import build_tokenizer
from jobs.common import parse, write_result

PERCENTILES = (50, 90, 99, 99.9)


def response_lengths(cfg: Config, tokenizer) -> np.ndarray:
    """Tokens of each training example's right response, EOS included."""
    train_path, _ = dataset_paths(cfg.task, cfg.model.cache_dir)
    examples = read_examples(train_path, cfg.task.prompt_key, cfg.task.answer_key)
    return np.array([len(tokenizer.encode(ex.answer)) + 1 for ex in examples])


def summary(lengths: np.ndarray, cap: int) -> dict:
    return {"num": len(lengths), "mean": float(lengths.mean()), "max": int(lengths.max()), "cap": cap,
            "share_at_max": float(np.mean(lengths == lengths.max())),
            **{f"p{p:g}": float(np.percentile(lengths, p)) for p in PERCENTILES}}


def plot(runs: dict[str, tuple[np.ndarray, int]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for i, (name, (lengths, cap)) in enumerate(runs.items()):
        x = np.sort(lengths)
        ax.step(x, 1.0 - np.arange(len(x)) / len(x), where="post", lw=1.2, color=f"C{i}",
                label=f"{name}: median {np.median(x):.0f}, p99 {np.percentile(x, 99):.0f}, mean {x.mean():.0f}")
        ax.axvline(cap, color=f"C{i}", ls="--", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("response tokens (dashed: the config's cap, sampling.max_response_len)")
    ax.set_ylabel("share of responses at least this long")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    def extra(p):
        p.add_argument("--compare", nargs="*", default=[], help="other configs, shown beside")
        p.add_argument("--plot", default="", help="histogram PNG")
        p.add_argument("--json", default="")

    cfg, args = parse(__doc__, extra)
    tokenizer = build_tokenizer()
    configs = {Path(args.config).stem: cfg} | {Path(c).stem: load_config(c) for c in args.compare}
    runs = {name: (response_lengths(c, tokenizer), c.sampling.max_response_len) for name, c in configs.items()}
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(runs, args.plot)
    write_result(args.json or None, {name: summary(x, cap) for name, (x, cap) in runs.items()})


if __name__ == "__main__":
    main()
