"""RL training with APRIL: the main job (the algorithm is driver/train.py).

    python -m jobs.train --config configs/tiny_cpu.yaml [key=value ...] [--summary PATH]
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python -m jobs.train --config ...
"""
from __future__ import annotations

from driver.train import train
from jobs.common import parse, write_result
from jobs.plan import check_memory


def main() -> None:
    cfg, args = parse(__doc__, lambda p: p.add_argument("--summary", help="write the summary JSON here"))
    check_memory(cfg)  # learner GPUs that cannot hold the memory plan stop the job before anything starts
    summary = train(cfg)
    write_result(args.summary, summary)


if __name__ == "__main__":
    main()
