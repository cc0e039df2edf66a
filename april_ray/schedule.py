"""The rollout schedules, one object each, chosen once by name (`rollout.schedule`).

They differ in three decisions, and the completion monitor asks the schedule for each:
- the in-flight target: how many more groups to start (april keeps N' in flight the whole step; sync keeps
  N; oversample starts N' and afterwards, as sync, starts only a group per one the filter's drops leave
  missing from N);
- whether a step asked to keep running may return at its N-th complete group with the rest still
  generating into the next step (april, the overlapped mode), instead of interrupting them;
- what becomes of the leftovers at the interrupt, the surplus complete groups and the unfinished ones:
  stored for the next step (april, sync), or discarded with their tokens (oversample, slime's rollout
  without partial rollout: the APRIL paper's baseline).
Every schedule keeps everything in the store when a step fails. This module sits beside `config.py`, which
takes its names and rules from it, and imports nothing of the package.
"""
from __future__ import annotations

from typing import ClassVar


class Schedule:
    name: ClassVar[str]
    over_provisions: ClassVar[bool] = True
    """N' (fixed or auto: rollout/over_sampling.py) groups may be in flight; else N."""
    keeps_running: ClassVar[bool] = False
    """A step asked to `keep_running` leaves its unfinished groups generating after its batch returns."""
    keeps_leftovers: ClassVar[bool] = True
    """At the interrupt, surplus complete groups and unfinished ones go to the store (else: discarded)."""

    def num_to_start(self, n: int, n_prime: int, num_complete: int, num_incomplete: int, started: bool) -> int:
        """Groups to start now, with `num_complete` of N complete (fewer than N) and `num_incomplete` in
        flight; `started`: the step has started any group (fresh or from the store)."""
        raise NotImplementedError

    def config_error(self, rollout) -> str | None:
        """What is wrong with `rollout` (a RolloutConfig) under this schedule, naming the key; None if nothing."""
        return None


class April(Schedule):
    """Over-provision N' groups, interrupt once N are complete, recycle the unfinished ones next step."""

    name = "april"
    keeps_running = True

    def num_to_start(self, n, n_prime, num_complete, num_incomplete, started):
        return n_prime - num_incomplete


class Sync(Schedule):
    """The synchronous baseline: N groups in flight, nothing interrupted."""

    name = "sync"
    over_provisions = False

    def num_to_start(self, n, n_prime, num_complete, num_incomplete, started):
        return n - num_complete - num_incomplete  # only refill what the filter dropped


class Oversample(Schedule):
    """N' groups start the step; at the N-th complete one the rest are aborted and discarded."""

    name = "oversample"
    keeps_leftovers = False

    def num_to_start(self, n, n_prime, num_complete, num_incomplete, started):
        target = n_prime if not started else n  # over-provision at the step's start only
        return target - num_complete - num_incomplete

    def config_error(self, rollout):
        if rollout.over_sampling_batch_size == "auto":
            return ("rollout.over_sampling_batch_size: auto adapts APRIL's N' (rollout.schedule=april); "
                    "the oversample baseline takes an integer")
        return None


SCHEDULES: dict[str, Schedule] = {s.name: s for s in (April(), Sync(), Oversample())}
"""`rollout.schedule` -> its schedule; the config takes its choices from here."""


def build_schedule(name: str) -> Schedule:
    """The schedule named `name` (a validated `rollout.schedule`)."""
    return SCHEDULES[name]
