"""A job restored in place when an actor other than an engine dies: a learner rank, the completion monitor,
the partial-rollout store or the prompt source.

The driver learns of the death where it waits (a call of the dead actor's, or of one that called it,
fails). Most errors name the dead actor (Ray's `ActorDiedError`, raised as is or as the cause of the calling
actor's error); only an error that names none of the job's actors asks every one of them whether it still
answers (`dead_actors`: a learner rank whose collective lost its peer, an object whose owner died), and one
with none dead is the job's own and stops it as before. Otherwise the engines keep running and everything else goes
back to the newest checkpoint, as `train.resume=true` would take it, without the engines' restart:

1. the monitor, store, source and learner ranks are killed (the living too: their state is past the
   checkpoint), and every call of the old monitor's steps is closed and aborted on the engines;
2. new ones start, and load the checkpoint (policy, optimiser, the source's cursor, the store, the
   monitor's counters); the engines are sent the restored policy under its version (version 0 and the
   initial policy without a checkpoint);
3. `groups.jsonl` and `metrics.jsonl` lose the rows of the steps after the checkpoint, which the loop
   then redoes: no prompt skipped or trained twice.

What is redone: the steps after the checkpoint (`train.save_every` bounds them). What is lost: the tokens
the engines generated for those steps. A returned tool call is answered from the journal when its
trajectory is replayed. Each restore is a row of `restores.jsonl` (what died, when, what was redone and
how long the restore took). A death during a restore, or one more than `train.max_restores`, stops the job
with one line (`JobStopped`) naming what died and the command that resumes it.
"""
from __future__ import annotations

import json
import time

import ray
from ray.exceptions import ActorDiedError, OutOfMemoryError, RayActorError

from driver.checkpoint import find_checkpoint, restore_checkpoint
from driver.learners import LearnerGroup
from driver.records import read_rows
from driver.rollout import RolloutGroup

RESTORES = "restores.jsonl"
PING_S = 15.0
"""How long `dead_actors` waits for all the pings together; an actor busy past it is taken as alive."""


class JobStopped(RuntimeError):
    """The job cannot go on by itself; the message is one line: what died, and the command that resumes it."""


class Restorer:
    def __init__(self, cfg, run, tracker):
        self.cfg, self.run, self.tracker = cfg, run, tracker
        self.num_restores = 0
        self.first_step = run.start
        """The first step the current monitor ran: its tokens from here on are what `abandon` closes."""

    def restore(self, error: Exception, step: int) -> tuple[int, int]:
        """After `error` in `step`: (the step to run next, the policy version the engines serve) once the
        job is back at its newest checkpoint. Re-raises `error` when no actor of the job died."""
        dead = self.dead_actors(error)
        if not dead:
            raise error
        what = " and ".join(dead)
        if self.num_restores >= self.cfg.train.max_restores:
            raise self.stopped(f"step {step}: {what} died after {self.num_restores} restores "
                               f"(train.max_restores={self.cfg.train.max_restores})") from error
        print(f"step {step}: {what} died ({type(error).__name__}); restoring the job to its newest checkpoint, "
              f"the engines kept", flush=True)
        t0, redone = time.time(), [r["step"] for r in read_rows(self.run.out) if "end" not in r]
        try:
            start, version, ckpt = self._restore(step)
        except Exception as e:
            raise self.stopped(f"step {step}: {what} died, and the restore failed ({type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''})"[:600]) from e
        self.num_restores += 1
        self.first_step = start
        row = {"died": dead, "failed_at_step": step, "checkpoint": ckpt, "from_step": start,
               "redone_steps": sorted(s for s in redone if s >= start), "restore_s": round(time.time() - t0, 3),
               "time": time.time()}
        with open(self.run.out / RESTORES, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"restored from {ckpt or 'the start'} in {row['restore_s']:.1f}s: step {start}, policy version "
              f"{version}", flush=True)
        return start, version

    def actors(self) -> list[tuple[str, object]]:
        """(name, handle) of every actor a restore replaces."""
        rollout, learners = self.run.rollout, self.run.learners
        named = [("the completion monitor", rollout.monitor), ("the partial-rollout store", rollout.store),
                 ("the prompt source", rollout.source)]
        return named + [(f"learner rank {r}", a) for r, a in enumerate(learners.actors)]

    def dead_actors(self, error: Exception, timeout_s: float = PING_S) -> list[str]:
        """The job's actors other than the engines that died: those `error` names, without asking anyone
        (a restore replaces them all, so a second death it does not name is restored too); when it names
        none, those that fail a ping, every one pinged at once."""
        named = self.actors()
        told = died_in(error)
        dead = [name for name, actor in named if actor._actor_id.hex() in told]
        return dead or unanswered(named, timeout_s)

    def _restore(self, step: int) -> tuple[int, int, str | None]:
        run, cfg = self.run, self.cfg
        run.rollout.shutdown()
        run.learners.shutdown()
        run.rollout.abandon(self.first_step, step)
        run.rollout = RolloutGroup.start(cfg, run.inputs.model_path, run.inputs.train_path, run.engines)
        run.learners = LearnerGroup(cfg, run.inputs.model_path, run.engines)
        run.engines.take_weights_from(run.learners.weights_ref)
        ckpt = find_checkpoint(run.out, run=run.lock.run)
        if ckpt is None:
            start, version = 0, 0
            run.learners.publish(run.engines, version)  # the initial policy, as the job began
        else:
            start, version = restore_checkpoint(ckpt, run.learners, run.rollout, run.engines)
        self.tracker.cut_back(run.out, start - 1)
        return start, version, ckpt and ckpt.name

    def stopped(self, what: str) -> JobStopped:
        resume = f"python -m jobs.train --config {self.run.out / 'config.yaml'} train.resume=true"
        ckpt = find_checkpoint(self.run.out, log=lambda _: None, run=self.run.lock.run)
        where = f"from {ckpt.name}" if ckpt else "from step 0 (no checkpoint yet)"
        return JobStopped(f"{what}. The job stops; `{resume}` goes on {where}")


def died_in(error: BaseException) -> set[str]:
    """The actor ids (hex) that `error` says died: its own `ActorDiedError`, or one it was caused by (a call
    of another actor that failed on the dead one: Ray's `RayTaskError` with the death as its `cause`)."""
    ids, seen, todo = set(), set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ActorDiedError) and getattr(e, "actor_id", None):
            ids.add(e.actor_id)
        todo += [getattr(e, "cause", None), e.__cause__, e.__context__]
    return ids


def unanswered(named: list[tuple[str, object]], timeout_s: float) -> list[str]:
    """The names of the actors whose ping fails within `timeout_s` (one deadline for all of them)."""
    pings = [actor.__ray_ready__.remote() for _, actor in named]
    ready, _ = ray.wait(pings, num_returns=len(pings), timeout=timeout_s)
    dead = []
    for (name, _), ping in zip(named, pings):
        if ping in ready:
            try:
                ray.get(ping)
            except (RayActorError, OutOfMemoryError):
                dead.append(name)
    return dead
