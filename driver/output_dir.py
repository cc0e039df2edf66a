"""One writer per output directory: a job holds an exclusive lock on `train.output_dir` for its whole life.

Two jobs in one directory would interleave their metrics rows and write over each other's checkpoints. The
lock is the kernel's (`flock` on `.lock` in the directory), so it dies with the process that holds it: a
SIGKILLed job leaves nothing that stops the next one. The file also says who holds it (pid, host, run id),
which is how a second job names the holder when it stops; its text is only a label, the lock is the flock.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = ".lock"


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
        """Record this job's run id in the lock file, for a job refused here to name."""
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
