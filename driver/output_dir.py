"""An output directory's owner and its lineage of runs.

One writer per output directory: a job holds an exclusive lock on `train.output_dir` for its whole life.
Two jobs in one directory would interleave their metrics rows and write over each other's checkpoints. The
lock is the kernel's (`flock` on `.lock` in the directory), so it dies with the process that holds it: a
SIGKILLed job leaves nothing that stops the next one. The file also says who holds it (pid, host, run id),
which is how a second job names the holder when it stops; its text is only a label, the lock is the flock.

A run is a lineage: a fresh job (`train.resume=false`) starts a new one in the directory (`start_run`: its
id in the file `run`, and in every checkpoint's manifest), and a resume goes on with it. A fresh job never
erases an earlier run: its files are set aside in `runs/<its run id>` first (`set_aside`). A resume never
picks up, nor writes over, the checkpoint of another run: one there stops it (`open_run`), named. The
checkpoints themselves (their format, finding the newest, verifying one) are `checkpoint.py`'s.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import time
import uuid
from pathlib import Path

from driver.checkpoint import (LATEST, CheckpointError, checked, claimed_run, find_checkpoint, incomplete_reason,
                               is_checkpoint_name, named_by_latest, run_of, write_synced)

LOCK_FILE = ".lock"
RUN_FILE = "run"


class OutputDirBusy(RuntimeError):
    """Another job holds the output directory; the message names it (pid, host, run id)."""


class OutputLock:
    def __init__(self, out_dir: Path, run: str | None):
        """Take `out_dir` (created if missing) for this process, recording `run` as its run id (None: not
        known yet), or raise OutputDirBusy naming the job that holds it."""
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / LOCK_FILE
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)  # never truncated before the lock is ours
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise OutputDirBusy(f"{out_dir}: another job writes here ({describe(holder(self.path))}); it holds "
                                f"{self.path} until it ends. Wait for it, or choose another train.output_dir"
                                ) from None
        except OSError as e:
            os.close(self.fd)
            raise OutputDirBusy(f"{self.path}: cannot lock it ({e.strerror}); train.output_dir must be on a file "
                                f"system that supports flock") from None
        self.name_run(run)

    def name_run(self, run: str | None) -> None:
        """Record this job's run id (`run`) in the lock file, for a job refused here to name."""
        self.run = run
        text = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "run": run})
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, text.encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # the lock goes with the last descriptor of the open file
            self.fd = None


def holder(path: Path, wait_s: float = 2.0) -> dict:
    """What the holder of `path` wrote about itself; {} if it has not written yet (it truncates, then
    writes, just after it takes the lock), or what it wrote cannot be read."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            found = json.loads(path.read_text())
            if isinstance(found, dict) and found.get("pid") is not None and not _gone(found):
                return found
        except (OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            return {}
        time.sleep(0.05)


def _gone(found: dict) -> bool:
    """A process of this host that no longer runs: an earlier holder's text, not yet replaced."""
    if found.get("host") != socket.gethostname():
        return False
    try:
        os.kill(int(found["pid"]), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError, TypeError, OverflowError):
        return False
    return False


def describe(found: dict) -> str:
    if not found:
        return "a job that has not said which yet"
    run = found.get("run") or "not opened yet"
    return f"pid {found.get('pid')} on {found.get('host')}, run {run}"


# -- the run's lineage ------------------------------------------------------------------------------
def current_run(out_dir: Path) -> str | None:
    """The run id the file `run` of an output directory names (None: none there)."""
    f = out_dir / RUN_FILE
    return (f.read_text().strip() or None) if f.is_file() else None


def new_run_id() -> str:
    """A fresh run's id: 16 hex digits."""
    return uuid.uuid4().hex[:16]


def start_run(out_dir: Path, resume: bool, new_run: str | None = None) -> str:
    """This job's run id. A resume's is the one in `out_dir/run` (with none there: that of the checkpoint
    `latest` names, or else of the newest complete one, so checkpoints copied into a new directory are
    still resumed from). A fresh job writes a new one (`new_run`, if given) and drops the `latest`
    pointer, which names an earlier run's checkpoint."""
    run = None
    if resume:
        if run := current_run(out_dir):
            return run
        named = named_by_latest(out_dir)
        ckpt = named if named is not None and incomplete_reason(named) is None else find_checkpoint(out_dir, lambda _: None)
        run = run_of(ckpt) if ckpt is not None else None
    else:
        (out_dir / LATEST).unlink(missing_ok=True)
    run = run or new_run or new_run_id()
    write_synced(out_dir / RUN_FILE, run)
    return run


def open_run(out_dir: Path, train, log=print, new_run: str | None = None) -> Path | None:
    """Start this job's run in `out_dir`; returns the checkpoint to resume from (None: step 0), its
    contents and state checked (`check_contents`, `read_state`) before anything starts.

    A fresh job (`train.resume=false`) never erases an earlier run: its files are moved to
    `out_dir/runs/<its run id>` first (`set_aside`), and it starts run `new_run` (None: a new id). A
    resume goes on with the run of `out_dir`. It stops, naming each checkpoint and why, when another
    run's checkpoints are there (its saves would write over them), or when its own saved checkpoints are
    all unusable (its next save would overwrite one), unless `train.start_over`: then it starts a new run
    as a fresh job does. A checkpoint past train.num_steps stops it too: there is nothing left to train."""
    if train.resume:
        run = start_run(out_dir, resume=True)
        foreign = other_runs(out_dir, run)
        rejected = list(foreign)
        ckpt = find_checkpoint(out_dir, log, run, rejected)
        if not foreign and (ckpt is not None or not rejected):
            return ckpt if ckpt is None else checked(ckpt, train.num_steps)
        if not train.start_over:
            what = "another run's checkpoints are" if foreign else "no usable checkpoint is"
            raise CheckpointError(
                f"train.resume: {what} in {out_dir}; {_rejections(rejected)}. Nothing was changed. Repair or move "
                f"them, or add train.start_over=true to start a new run from step 0 (this directory's run files are "
                f"moved to {out_dir / EARLIER_RUNS} first).")
        log(f"checkpoint: train.start_over: {len(rejected)} checkpoints rejected; starting a new run")
    set_aside(out_dir, log)
    start_run(out_dir, resume=False, new_run=new_run)
    return None


def _rejections(rejected: list[tuple[Path, str]], most: int = 5) -> str:
    """`ckpt-000004, ckpt-000009: why; ckpt-000010: why`: the checkpoints of one reason together."""
    by_reason: dict[str, list[str]] = {}
    for path, why in rejected:
        by_reason.setdefault(why, []).append(path.name)
    return "; ".join(", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")
                     + f": {why}" for why, names in by_reason.items())


def other_runs(out_dir: Path, run: str) -> list[tuple[Path, str]]:
    """(path, why) of each checkpoint in `out_dir` whose manifest names a run other than `run`, complete or
    not: a resume of `run` saving its steps would write over them. Only the run id is read."""
    found = []
    for path in sorted(out_dir.glob("*ckpt-*")):
        other = claimed_run(path)
        if other is not None and other != run:
            found.append((path, f"belongs to run {other}, not to run {run} that {out_dir / RUN_FILE} names"))
    return found


EARLIER_RUNS = "runs"
RUN_RECORDS = {RUN_FILE, LATEST, "config.yaml", "wandb_run_id", "wandb", "tensorboard", "weights"}
"""What a run leaves in its output directory besides its checkpoints and `*.jsonl` step logs."""


def set_aside(out_dir: Path, log=print) -> Path | None:
    """Move an earlier run's files in `out_dir` (records, step logs, checkpoints) to
    `out_dir/runs/<its run id>`, where `train.output_dir=<that directory> train.resume=true` goes on with it.
    Other files stay. Returns where they went (None: there were none)."""
    mine = [p for p in out_dir.iterdir() if p.name in RUN_RECORDS or p.suffix == ".jsonl" or is_checkpoint_name(p.name)]
    if not mine:
        return None
    name = current_run(out_dir) or "unnamed"
    if not re.fullmatch(r"[\w-]{1,64}", name):  # a run id is hex: anything else is not made a path
        name = "unnamed"
    dest = out_dir / EARLIER_RUNS / name
    n = 1
    while dest.exists():
        n += 1
        dest = out_dir / EARLIER_RUNS / f"{name}-{n}"
    dest.mkdir(parents=True)
    for p in mine:
        p.rename(dest / p.name)
    log(f"{out_dir} held an earlier run: its {len(mine)} files moved to {dest} (nothing deleted; "
        f"train.output_dir={dest} train.resume=true continues it)")
    return dest
