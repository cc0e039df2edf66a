"""The job's own record of where every group went: `groups.jsonl` in `train.output_dir`.

One row per step, written before that step's checkpoint (so a resumed run never lacks the rows of the
steps it kept): the group ids returned for training with their sample ids, the groups the dynamic filter
dropped with the reason (or as `episode_error`, each raising sample's error in `episode_errors`), those
the over-provisioned baseline discarded, the trained tokens by age, and the engine crashes the monitor saw, and when the row was written.
A last row, `"end": true`, holds the prompt source's cursor and the ids of the groups left in the store.
Together they account for every group taken from the source: returned, dropped, discarded or stored
(`check_records`, which the chaos job runs). A step of the overlapped mode also names the groups it left
running on the engines; the last step leaves none.
"""
from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path

from april_ray.config import StalenessConfig
from april_ray.types import StepResult


def staleness_metrics(hist: dict[int, int], staleness: StalenessConfig) -> dict[str, float]:
    """Batch tokens by age in policy versions, as fractions (rollout/staleness_hist/<age>), and the age of
    the oldest token the learner does not mask (rollout/max_trained_staleness)."""
    total = max(1, sum(hist.values()))
    return {f"rollout/staleness_hist/{age}": n / total for age, n in hist.items()} | {
        "rollout/max_trained_staleness": staleness.oldest_trained(hist)}


class PhaseClock:
    """Seconds per phase of a step (`time/<phase>_s`) and their totals over the run."""

    def __init__(self):
        self.totals: dict[str, float] = {}

    def start(self) -> None:
        self.t, self.step = time.perf_counter(), {}

    def mark(self, phase: str) -> None:
        """The time since the last mark (or the start) was spent in `phase`."""
        now = time.perf_counter()
        self.step[phase] = now - self.t
        self.totals[phase] = self.totals.get(phase, 0.0) + now - self.t
        self.t = now

    def metrics(self) -> dict[str, float]:
        return {f"time/{phase}_s": seconds for phase, seconds in self.step.items()}


class IdleShares:
    """The engines' and the learner's idle shares of the job's wall time so far: 1 - busy seconds / (wall
    seconds, times the engines). An engine's busy seconds are its own count of time spent stepping a
    non-empty batch, which a restarted engine starts again from zero; the learner is busy training and
    sending weights (the driver's `learner` and `weight_sync` phases)."""

    def __init__(self, engine_busy_s: list[float | None]):
        self.t0 = time.perf_counter()
        self.last = list(engine_busy_s)
        self.engine_busy_s = 0.0

    def metrics(self, engine_busy_s: list[float | None], phase_totals: dict[str, float]) -> dict[str, float]:
        for e, busy in enumerate(engine_busy_s):
            if busy is not None:  # None: down now; its seconds are counted once it answers
                last = self.last[e]
                self.engine_busy_s += busy - last if last is not None and busy >= last else busy
                self.last[e] = busy
        wall = max(1e-9, time.perf_counter() - self.t0)
        learner = phase_totals.get("learner", 0.0) + phase_totals.get("weight_sync", 0.0)
        return {"job/engine_idle_fraction": max(0.0, 1.0 - self.engine_busy_s / (wall * len(self.last))),
                "job/learner_idle_fraction": max(0.0, 1.0 - learner / wall)}


class GroupLog:
    def __init__(self, out_dir: Path, staleness: StalenessConfig, fresh: bool = True):
        """`fresh`: a new run starts a new file; a resumed one appends (after the resume truncated it)."""
        self.path = Path(out_dir) / "groups.jsonl"
        self.staleness = staleness
        if fresh:
            self.path.unlink(missing_ok=True)

    def step(self, step: int, version: int, batch: StepResult) -> None:
        self._write({
            "step": step, "version": version,
            "returned": list(batch.returned_group_ids),
            "samples": {gid: [m.sample_id for m in metas] for gid, metas in zip(batch.returned_group_ids, batch.metas)},
            "dropped": dict(batch.dropped),
            "episode_errors": dict(batch.episode_errors),
            "discarded": list(batch.discarded),
            "running": list(batch.running),
            "staleness": {str(age): n for age, n in batch.staleness.items()},
            "max_versions": self.staleness.max_versions, "policy": self.staleness.policy,
            "max_trained_staleness": self.staleness.oldest_trained(batch.staleness),
            "engine_crashes": batch.metrics.get("rollout/engine_crashes", 0),
            "crash_tokens_lost": batch.metrics.get("rollout/crash_tokens_lost", 0), "time": time.time()})

    def end(self, step: int, source_state: dict, store_state: dict) -> None:
        self._write({"step": step, "end": True, "source": source_state,
                     "store": {kind: [group_id(g) for g in store_state[kind]] for kind in ("partial", "complete")}})

    def _write(self, row: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def group_id(group) -> str:
    """A stored group's id, whether the store's state holds groups or their JSON form."""
    return group["group_id"] if isinstance(group, dict) else group.group_id


def read_rows(out_dir: Path) -> list[dict]:
    path = Path(out_dir) / "groups.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


# -- reading the records back: the chaos checks ------------------------------------------------------
def taken_group_ids(source_state: dict) -> list[str]:
    """The ids of every group a fresh prompt source handed out, from its final cursor (prompt_source.py)."""
    n, epoch, position = source_state["num_examples"], source_state["epoch"], source_state["position"]
    return [f"e{e}p{p}" for e in range(epoch + 1) for p in range(n if e < epoch else position)]


def check_records(out_dir: Path, n_samples: int) -> dict:
    """Lost and duplicated samples, the oldest trained token and the crashes, from `groups.jsonl`."""
    rows = read_rows(out_dir)
    steps = [r for r in rows if "end" not in r]
    end = next((r for r in reversed(rows) if r.get("end")), None)
    returned = Counter(g for r in steps for g in r["returned"])
    samples = Counter(s for r in steps for ids in r["samples"].values() for s in ids)
    dropped = Counter(g for r in steps for g in r["dropped"])
    discarded = Counter(g for r in steps for g in r.get("discarded", []))  # rows before the baseline had none
    stored = Counter(end["store"]["partial"] + end["store"]["complete"]) if end else Counter()
    placed = returned + dropped + discarded + stored
    taken = taken_group_ids(end["source"]) if end else sorted(placed)
    lost = sum(n_samples for g in taken if g not in placed)
    lost += sum(n_samples - len(set(ids)) for r in steps for ids in r["samples"].values())
    duplicated = sum(c - 1 for c in samples.values() if c > 1)
    # a group dropped, discarded or stored more than once, or also trained: its samples are counted again
    duplicated += sum(max(0, c - (0 if g in returned else 1)) * n_samples
                      for g, c in (dropped + discarded + stored).items())
    return {
        "steps_completed": len({r["step"] for r in steps}),
        "groups_taken": len(taken), "groups_returned": sum(returned.values()),
        "groups_dropped": sum(dropped.values()), "groups_discarded": sum(discarded.values()),
        "groups_stored": sum(stored.values()),
        "dropped_reasons": dict(Counter(reason for r in steps for reason in r["dropped"].values())),
        "unknown_groups": len(set(placed) - set(taken)),
        "lost_samples": lost, "duplicated_samples": duplicated,
        "max_trained_staleness": max((StalenessConfig(max_versions=r["max_versions"], policy=r["policy"])
                                      .oldest_trained({int(a): c for a, c in r["staleness"].items()})
                                      for r in steps), default=0),
        "engine_crashes_seen": sum(r["engine_crashes"] for r in steps),
        "crash_tokens_lost": sum(r["crash_tokens_lost"] for r in steps),
        "complete_record": end is not None,
    }


TRAINING_SAMPLE = re.compile(r"e\d+p\d+s\d+")
"""Sample ids of training (epoch, prompt, sample); evaluation's have another form."""
