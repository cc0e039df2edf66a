"""Chaos: the training job on a local Ray while engine processes are killed, then its accounting checked.

    python -m jobs.chaos --config configs/tiny_cpu.yaml --kills K --json PATH [--seed S] [key=value ...]
    python -m jobs.chaos --config configs/tiny_cpu.yaml --kill-actors learner,monitor,store,source --json PATH
    python -m jobs.chaos --config configs/tiny_cpu.yaml --driver-kills N --json PATH [key=value ...]
    python -m jobs.chaos --config configs/tiny_cpu.yaml --node-churn --json PATH [key=value ...]

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

`--kill-actors learner,monitor,store,source,journal` kills one process of each named actor instead, one at
a time in a seeded random order, each once the job is back from the one before (a step finished after
its restore), with no resume by hand: the job restores itself in place (driver/restore.py). The result
adds, per kill, its recovery time (from the kill to the next step finished after the restore), the
checkpoint restored and the steps redone (`actor_kills`). The journal exists with episodes only (else it is
listed in `actors_absent`). A checkpoint every 3 steps unless `train.save_every` is given.

`--driver-kills N` kills the driver instead and resumes it (jobs/chaos_driver.py).

`--node-churn` runs an elastic fleet on a multi-raylet cluster of this machine instead, while a worker node is
preempted gracefully, one joins and another is lost by SIGKILL of its raylet (jobs/chaos_nodes.py).

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
from driver.restore import RESTORES
from jobs.chaos_driver import ToolRecords, read_jsonl, run_driver_kills, tool_calls_across_kills
from jobs.chaos_nodes import NODE_CHURN_DEFAULTS, run_node_churn

DEFAULTS = ["train.num_steps=30", "task.num_eval=128", "train.eval_every=10", "train.output_dir=outputs/chaos",
            "logging.wandb_mode=disabled"]
ACTOR_DEFAULTS = ["train.save_every=3"]
"""With --kill-actors: a checkpoint every 3 steps, so a restore redoes at most 3 (a save costs ~0.2 s here)."""


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


ACTOR_TITLES = {"engine": b"ray::EngineWorkerActor", "learner": b"ray::LearnerActor",
                "monitor": b"ray::CompletionMonitorActor", "store": b"ray::StoreActor",
                "source": b"ray::PromptSourceActor", "journal": b"ray::ToolJournalActor", "metrics": b"ray::StepMetrics"}
"""The process title Ray gives each actor's process (`ray::<class>`, then `.<method>` while it runs one)."""


def actor_pids(kind: str = "engine") -> list[int]:
    """This job's processes of the actor `kind` (a key of ACTOR_TITLES)."""
    title = ACTOR_TITLES[kind]
    return sorted(pid for pid, cmd in descendants(os.getpid()).items()
                  if cmd.startswith(title) and cmd[len(title):len(title) + 1] in (b"", b".", b"\0", b" "))


def engine_pids() -> list[int]:
    return actor_pids("engine")


class Killer(threading.Thread):
    """SIGKILLs one process of each actor kind in `targets` (in that order) at seeded random moments of the
    run in `out_dir`: after a step drawn at random (`at_steps`), a random delay up to the mean step time.
    With `wait_recovery`, a kill waits for a step to finish after the one before (the job restores itself
    in place between them: a death during a restore stops it by design)."""

    def __init__(self, targets: list[str], num_steps: int, out_dir: Path, seed: int, wait_recovery: bool = False):
        super().__init__(daemon=True)
        self.rng = random.Random(seed)
        self.targets = list(targets)
        last = max(2, num_steps - 1)
        # one after the other, each after a recovery: drawn from the first two thirds, so that all land
        first = max(len(targets) + 1, 2 * num_steps // 3)
        self.at_steps = (sorted(self.rng.sample(range(1, min(first, last)), len(targets))) if wait_recovery
                         else sorted(self.rng.randrange(1, last) for _ in targets))
        self.wait_recovery = wait_recovery
        self.out_dir = out_dir
        self.done: list[dict] = []
        self.stop = threading.Event()
        self.tools: list[ToolRecords] = []
        """The tool runs and the journal as each kill left them: what a replayed episode finds there."""
        self.error: str | None = None

    def rows(self) -> list[dict]:
        """The step rows recorded so far; a row the job is still writing (a torn last line) is not one yet."""
        path = self.out_dir / "groups.jsonl"
        lines = path.read_text().split("\n")[:-1] if path.is_file() else []  # the text after the last newline is torn
        return [r for r in (json.loads(line) for line in lines if line.strip()) if "end" not in r]

    def steps_done(self) -> tuple[int, float]:
        """(steps recorded so far, the (lower) median seconds between two step rows: a step's time, a
        restore's pause left out)."""
        rows = self.rows()
        times = sorted(r["time"] for r in rows if "time" in r)
        gaps = sorted(b - a for a, b in zip(times, times[1:]))
        return len(rows), gaps[(len(gaps) - 1) // 2] if gaps else 1.0

    def recovered(self, kill: dict) -> bool:
        """Whether the job is back after `kill`; the moment it was seen back is kept in it (`back_t`): a later
        restore may cut the step rows that showed it."""
        if "back_t" not in kill and recovered_at(kill, self.rows(), read_jsonl(self.out_dir / RESTORES)):
            kill["back_t"] = time.time()
        return "back_t" in kill

    def run(self) -> None:
        try:
            self.kill_all()
        except Exception as e:  # reported in the result: a kill that did not land must not pass unseen
            self.error = f"{type(e).__name__}: {e}"
            raise

    def kill_all(self) -> None:
        step_s = 1.0
        for target, at in zip(self.targets, self.at_steps):
            while not self.stop.is_set():
                back = not self.wait_recovery or not self.done or self.recovered(self.done[-1])  # checked first
                n, step_s = self.steps_done()
                if back and n >= at:
                    break
                time.sleep(0.1)
            if self.stop.wait(self.rng.uniform(0, step_s)):
                return
            self.kill_one(target, at)
        while self.wait_recovery and self.done and not self.recovered(self.done[-1]) and not self.stop.wait(0.1):
            pass

    def kill_one(self, target: str, at: int) -> None:
        deadline = time.time() + 120
        while not self.stop.is_set() and time.time() < deadline:
            pids = actor_pids(target)
            if pids:
                pid = self.rng.choice(pids)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                self.done.append({"actor": target, "after_step": at, "pid": pid, "t": time.time()})
                print(f"chaos: SIGKILL {target} process {pid} after step {at}", flush=True)
                time.sleep(0.5)  # a journal write the engine sent just before has landed; a replay is ~1 s away
                self.tools.append(ToolRecords.read(self.out_dir))
                return
            time.sleep(0.2)
        if not self.stop.is_set():
            raise RuntimeError(f"no {target} process to kill after step {at} within 120 s")


RESTARTED_BY_RAY = {"engine", "journal", "metrics"}
"""Actors Ray restarts in place; the job restores itself after the others' deaths (driver/restore.py)."""


def recovered_at(kill: dict, rows: list[dict], restores: list[dict]) -> float | None:
    """When the job was back after `kill`: the first step it finished after the kill and, for an actor whose
    death the job restores, after that restore (None: not yet). A step finished between the kill and the
    restore (the death not yet seen) is redone, so it does not count."""
    since = kill["t"]
    if kill["actor"] not in RESTARTED_BY_RAY:
        restore = next((r for r in restores if r["time"] > since), None)
        if restore is None:
            return None
        since = restore["time"]
    return min((r["time"] for r in rows if r.get("time", 0) > since), default=None)


class EngineKiller(Killer):
    """Kills `kills` engine processes at seeded random moments of the run in `out_dir`."""

    def __init__(self, kills: int, num_steps: int, out_dir: Path, seed: int):
        super().__init__(["engine"] * kills, num_steps, out_dir, seed)


def run_engine_kills(cfg, args) -> dict:
    """The job with `args.kills` engine processes killed."""
    return run_with_killer(cfg, EngineKiller(args.kills, cfg.train.num_steps, Path(cfg.train.output_dir), args.seed))


def run_actor_kills(cfg, args) -> dict:
    """The job with one process of each actor of `args.kill_actors` killed, in a random order; each death
    is survived in place (driver/restore.py). The result gives each kill's recovery time (from the kill to
    the next step finished) and the steps redone."""
    kinds = [k for k in args.kill_actors if k != "journal" or cfg.rollout.episode_fn]  # no episodes: no journal
    random.Random(args.seed).shuffle(kinds)
    killer = Killer(kinds, cfg.train.num_steps, Path(cfg.train.output_dir), args.seed, wait_recovery=True)
    result = run_with_killer(cfg, killer)
    result["actors_absent"] = [k for k in args.kill_actors if k not in kinds]
    result["actor_kills"] = recoveries(Path(cfg.train.output_dir), killer.done)
    result["restores"] = len(read_jsonl(Path(cfg.train.output_dir) / RESTORES))
    result["ok"] = result["ok"] and all(k["recovery_s"] is not None for k in result["actor_kills"])
    return result


def recoveries(out: Path, kills: list[dict]) -> list[dict]:
    """Each kill with its recovery time (to the first step row written after it) and the steps the restore
    it caused redid (none where nothing was restored: Ray restarted the actor)."""
    rows = [r for r in read_jsonl(out / "groups.jsonl") if "end" not in r]
    restores = read_jsonl(out / RESTORES)
    report = []
    for i, kill in enumerate(kills):
        until = kills[i + 1]["t"] if i + 1 < len(kills) else float("inf")
        back = kill.get("back_t") or recovered_at(kill, rows, restores)  # seen live (within 0.1 s), else read back
        restore = next((r for r in restores if kill["t"] < r["time"] < until), None)
        report.append({"actor": kill["actor"], "after_step": kill["after_step"],
                       "recovery_s": None if back is None else round(back - kill["t"], 2),
                       "restored": restore is not None, "died": restore and restore["died"],
                       "failed_at_step": restore and restore["failed_at_step"],
                       "checkpoint": restore and restore["checkpoint"],
                       "redone_steps": restore["redone_steps"] if restore else [],
                       "restore_s": restore and restore["restore_s"]})
    return report


def run_with_killer(cfg, killer: Killer) -> dict:
    import ray

    from driver.train import train

    out = Path(cfg.train.output_dir)
    for name in ("groups.jsonl", RESTORES):  # the killer counts this run's rows only
        (out / name).unlink(missing_ok=True)
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
    result = {"kills": len(killer.done), "kills_requested": len(killer.targets), "kill_steps": killer.at_steps,
              "steps": cfg.train.num_steps, "staleness_bound": cfg.staleness.max_versions,
              "staleness_policy": cfg.staleness.policy, "wall_s": time.time() - t0,
              "accuracy_before": summary.get("accuracy_before"), "accuracy_after": summary.get("accuracy_after"),
              "time_s": summary.get("time_s"), "engine_restarts": last_metric(out, "engine/restarts"),
              "error": error, "killer_error": killer.error}
    result |= check_records(out, cfg.rollout.n_samples_per_prompt)
    result |= tool_calls_across_kills(ToolRecords.read(out), killer.tools)
    bounded = cfg.staleness.trains(result["max_trained_staleness"])
    result["ok"] = (error is None and killer.error is None and result["kills"] == len(killer.targets)
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
    parser.add_argument("--kill-actors", type=lambda v: [k for k in v.split(",") if k], default=[],
                        help=f"actors to SIGKILL once each, comma-separated, of: {', '.join(ACTOR_TITLES)}")
    parser.add_argument("--driver-kills", type=int, default=0, help="times to SIGKILL the driver and resume it")
    parser.add_argument("--node-churn", action="store_true",
                        help="an elastic fleet on a multi-raylet cluster: a node preempted, one joining, one lost")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    parser.add_argument("--json", help="write the result JSON here")
    args = parser.parse_intermixed_args()
    args.overrides = (DEFAULTS + (ACTOR_DEFAULTS if args.kill_actors else [])
                      + (NODE_CHURN_DEFAULTS if args.node_churn else []) + args.overrides)
    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        parser.error(str(e))
    if args.kills < 0 or args.driver_kills < 0:
        parser.error("--kills and --driver-kills must be at least 0")
    unknown = sorted(set(args.kill_actors) - set(ACTOR_TITLES))
    if unknown:
        parser.error(f"--kill-actors: {', '.join(unknown)}: not one of {', '.join(ACTOR_TITLES)}")
    if sum(map(bool, (args.kill_actors, args.kills or args.driver_kills, args.node_churn))) > 1:
        parser.error("--kill-actors and --node-churn each run on their own (not with --kills or --driver-kills)")
    result = {}
    if args.node_churn:
        result |= run_node_churn(cfg)
    elif args.kill_actors:
        result |= run_actor_kills(cfg, args)
    elif args.kills or not args.driver_kills:
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
