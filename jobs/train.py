"""RL training with APRIL: the main job (the algorithm is driver/train.py).

    python -m jobs.train --config configs/tiny_cpu.yaml [key=value ...] [--summary PATH]
    ray job submit --address http://127.0.0.1:8265 --working-dir . -- python -m jobs.train --config ...

A user's error (a bad dataset row, a missing model, an unusable checkpoint, another job in
train.output_dir) ends the job with one line naming the file, line or key; its traceback goes to
`errors.log` in train.output_dir.
"""
from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

from driver.output_dir import OutputDirBusy
from jobs.common import parse, write_result
from jobs.plan import check_memory

ERRORS_LOG = "errors.log"


def main() -> None:
    cfg, args = parse(__doc__, lambda p: p.add_argument("--summary", help="write the summary JSON here"))
    check_memory(cfg)  # learner GPUs that cannot hold the memory plan stop the job before anything starts
    from driver.train import train  # here, so that --help and --print-config answer without importing torch

    try:
        summary = train(cfg)
    except Exception as e:
        message = users_error(e)
        if message is None:
            raise
        if not isinstance(e, OutputDirBusy):  # (that directory is the other job's)
            message += f" (traceback in {log_traceback(Path(cfg.train.output_dir), e)})"
        raise SystemExit(f"error: {message}") from None
    write_result(args.summary, summary)


def users_error(e: Exception) -> str | None:
    """The one line a person needs, for an error of theirs (None: not one): another job in the output
    directory, or a ValueError (bad data, model, checkpoint or config, each naming its file, line or key),
    raised here or in an actor (whose error arrives wrapped by Ray, its traceback in the message)."""
    import ray.exceptions

    from driver.restore import JobStopped

    if isinstance(e, (OutputDirBusy, JobStopped)):
        return str(e)
    if isinstance(e, ray.exceptions.RayTaskError):
        cause = e.cause
        return f"{cause}".splitlines()[0] if isinstance(cause, ValueError) and str(cause) else None
    if isinstance(e, ray.exceptions.ActorDiedError):
        return _creation_error(str(e)) if e.actor_init_failed else None
    if isinstance(e, ValueError) and str(e):
        return str(e).splitlines()[0]
    return None


def _creation_error(text: str) -> str | None:
    """The message of the ValueError an actor's constructor raised, from its traceback as Ray words it."""
    for line in reversed(text.splitlines()):
        head, sep, message = line.partition(": ")
        if sep and head.split(".")[-1].endswith(("ValueError", "ConfigError", "CheckpointError")):
            return message
    return None


def log_traceback(out_dir: Path, e: Exception) -> Path:
    """Append `e`'s traceback to the output directory's error log (nothing a run wrote is touched)."""
    log = out_dir / ERRORS_LOG
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(sys.argv)}\n")
            f.write("".join(traceback.format_exception(e)))
    except OSError:  # an output directory that cannot be written: the traceback goes to the terminal
        traceback.print_exception(e)
        return Path("the lines above")
    return log


if __name__ == "__main__":
    main()
