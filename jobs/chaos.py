"""Chaos: the training job on a local Ray while engine processes are killed, then its accounting checked.

    python -m jobs.chaos --config configs/tiny_cpu.yaml --kills K --json PATH [--seed S] [key=value ...]
    python -m jobs.chaos --config configs/tiny_cpu.yaml --driver-kills N --json PATH [key=value ...]

`--kills K` runs `driver.train.train` while a thread kills K engine worker processes with SIGKILL, as a user
would (`kill -9` of a `ray::EngineWorkerActor` process; only processes of this job's own Ray). The kills
fall at seeded random moments: K steps drawn at random, and within each a random delay up to the mean
step time so far, so they land mid-decode, mid-abort, mid-weight-update or mid-evaluation. The check reads
only the job's own records (`groups.jsonl`, driver/records.py): every group taken from the prompt source
must be returned for training exactly once, dropped by the filter, or left in the store, with each of its
samples once; no trained token may be older than the staleness bound; and no tool call of an episode whose
result was journaled may run again for its trajectory (the embedded agent task logs its calls to
$APRIL_RAY_TOOL_LOG; a call cut off by a kill before its result was journaled, and run again by the
replayed trajectory under the same idempotency key, is counted apart: `tool_calls_rerun_unjournaled`).

`--driver-kills N` kills the driver instead and resumes it (jobs/chaos_driver.py).

Without overrides the run is short: `train.num_steps=30`, a held-out set of 128 prompts evaluated every 10
steps, output in outputs/chaos, wandb off. Key=value overrides come after these and win.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import threading
import time
from pathlib import Path

from jobs.common import write_result
from april_ray.config import ConfigError, add_config_args, config_from_args
from driver.records import check_records
from jobs.chaos_driver import ToolRecords, run_driver_kills, tool_calls_across_kills

DEFAULTS = ["train.num_steps=30", "task.num_eval=128", "train.eval_every=10", "train.output_dir=outputs/chaos",
            "logging.wandb_mode=disabled"]
ENGINE_TITLE = b"ray::EngineWorkerActor"


def descendants(root: int) -> dict[int, bytes]:
    """pid -> command line of every process under `root` (Linux /proc)."""
    parent, cmdline = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    out = {}
    for pid in parent:
        p = pid
        while p in parent and p != root and p > 1:
            p = parent[p]
        if p == root and pid != root:
            out[pid] = cmdline[pid]
    return out


def engine_pids() -> list[int]:
    return sorted(pid for pid, cmd in descendants(os.getpid()).items() if cmd.startswith(ENGINE_TITLE))


class EngineKiller(threading.Thread):
    """Kills `kills` engine processes at seeded random moments of the run in `out_dir`."""

    def __init__(self, kills: int, num_steps: int, out_dir: Path, seed: int):
        super().__init__(daemon=True)
        self.rng = random.Random(seed)
        self.at_steps = sorted(self.rng.randrange(1, max(2, num_steps - 1)) for _ in range(kills))
        self.out_dir = out_dir
        self.done: list[dict] = []
        self.stop = threading.Event()
        self.first_row_s: float | None = None
        self.tools: list[ToolRecords] = []
        """The tool runs and the journal as each kill left them: what a replayed episode finds there."""
        self.error: str | None = None

    def steps_done(self) -> tuple[int, float]:
        """(steps recorded so far, mean seconds per step since the first one was seen). A row the job is
        still writing (a torn last line) is not counted yet."""
        path = self.out_dir / "groups.jsonl"
        lines = path.read_text().split("\n")[:-1] if path.is_file() else []  # the text after the last newline is torn
        n = sum(1 for line in lines if line.strip() and "end" not in json.loads(line))
        if n and self.first_row_s is None:
            self.first_row_s = time.time()
        return n, (time.time() - self.first_row_s) / (n - 1) if n > 1 else 1.0

    def run(self) -> None:
        try:
            self.kill_all()
        except Exception as e:  # reported in the result: a kill that did not land must not pass unseen
            self.error = f"{type(e).__name__}: {e}"
            raise

    def kill_all(self) -> None:
        step_s = 1.0
        for at in self.at_steps:
            while not self.stop.is_set():
                n, step_s = self.steps_done()
                if n >= at:
                    break
                time.sleep(0.1)
            if self.stop.wait(self.rng.uniform(0, step_s)):
                return
            self.kill_one(at)

    def kill_one(self, at: int) -> None:
        deadline = time.time() + 120
        while not self.stop.is_set() and time.time() < deadline:
            pids = engine_pids()
            if pids:
                pid = self.rng.choice(pids)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                self.done.append({"after_step": at, "pid": pid, "t": time.time()})
                print(f"chaos: SIGKILL engine process {pid} after step {at}", flush=True)
                time.sleep(0.5)  # a journal write the engine sent just before has landed; a replay is ~1 s away
                self.tools.append(ToolRecords.read(self.out_dir))
                return
            time.sleep(0.2)


def run_engine_kills(cfg, args) -> dict:
    import ray

    from driver.train import train

    out = Path(cfg.train.output_dir)
    killer = EngineKiller(args.kills, cfg.train.num_steps, out, args.seed)
    (out / "groups.jsonl").unlink(missing_ok=True)  # the killer counts this run's rows only
    tool_log = out / "tool_calls.jsonl"  # the embedded agent task's environment logs its calls here
    tool_log.unlink(missing_ok=True)
    os.environ["APRIL_RAY_TOOL_LOG"] = str(tool_log.resolve())  # before Ray starts: its workers inherit it
    killer.start()
    error, t0 = None, time.time()
    try:
        summary = train(cfg)
    except Exception as e:  # the check still runs: how far did it get, and was anything lost?
        error, summary = f"{type(e).__name__}: {e}", {}
    finally:
        killer.stop.set()
        ray.shutdown()
    result = {"kills": len(killer.done), "kills_requested": args.kills, "kill_steps": killer.at_steps,
              "steps": cfg.train.num_steps, "staleness_bound": cfg.staleness.max_versions,
              "staleness_policy": cfg.staleness.policy, "wall_s": time.time() - t0,
              "accuracy_before": summary.get("accuracy_before"), "accuracy_after": summary.get("accuracy_after"),
              "engine_restarts": last_metric(out, "engine/restarts"), "error": error,
              "killer_error": killer.error}
    result |= check_records(out, cfg.rollout.n_samples_per_prompt)
    result |= tool_calls_across_kills(ToolRecords.read(out), killer.tools)
    bounded = cfg.staleness.trains(result["max_trained_staleness"])
    result["ok"] = (error is None and killer.error is None and result["kills"] == args.kills
                    and result["steps_completed"] == result["steps"] and not result["lost_samples"]
                    and not result["duplicated_samples"] and bounded and not result["tool_calls_run_twice"])
    return result


def last_metric(out: Path, key: str):
    import json

    path = out / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return max((r[key] for r in rows if key in r), default=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser)
    parser.add_argument("--kills", type=int, default=0, help="engine processes to SIGKILL during the run")
    parser.add_argument("--driver-kills", type=int, default=0, help="times to SIGKILL the driver and resume it")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    parser.add_argument("--json", help="write the result JSON here")
    args = parser.parse_intermixed_args()
    args.overrides = DEFAULTS + args.overrides
    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        parser.error(str(e))
    if args.kills < 0 or args.driver_kills < 0:
        parser.error("--kills and --driver-kills must be at least 0")
    result = {}
    if args.kills or not args.driver_kills:
        result |= run_engine_kills(cfg, args)
    if args.driver_kills:
        driver = run_driver_kills(cfg, args)
        ok = result.get("ok", True) and driver.get("ok", True)
        result |= driver  # with both modes, the shared keys (steps, steps_completed) are the driver run's
        result["ok"] = ok
    write_result(args.json, result)
    if not result.get("ok", True):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
