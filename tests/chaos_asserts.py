"""What every chaos run must show, whatever was killed: the command's exit, and its JSON's accounting."""
import json
import subprocess
from pathlib import Path

FIELDS = ("ok", "error", "killer_error", "kills", "steps_completed", "steps", "lost_samples", "duplicated_samples",
          "unknown_groups", "max_trained_staleness", "staleness_bound")


def assert_chaos_ok(proc: subprocess.CompletedProcess, out: Path, kills: int, steps: int, bound: int) -> dict:
    """The run exited 0 after `kills` kills with `ok: true`: `steps` of `steps` steps, no sample lost or trained
    twice, no group it cannot place, no trained token older than `bound`. Returns the JSON for a test's own checks.
    (pytest rewrites no assert outside test files, so each one says what it saw.)"""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    seen = f"{out}: " + ", ".join(f"{k}={r.get(k)!r}" for k in FIELDS)
    assert r["ok"] and r["error"] is None and r["killer_error"] is None and r["kills"] == kills, seen
    assert r["steps_completed"] == r["steps"] == steps, seen
    assert r["lost_samples"] == 0 and r["duplicated_samples"] == 0 and r["unknown_groups"] == 0, seen
    assert r["max_trained_staleness"] <= r["staleness_bound"] == bound, seen
    return r
