"""The training job's driver: the algorithm, step by step (`python -m jobs.train` runs it).

Each step: an APRIL rollout (over-provision, interrupt, recycle) returns N complete groups as object
refs; the learner ranks fetch their shares and take one optimiser step; the new weights are published
once and every engine adopts them under the next policy version. Held-out accuracy is evaluated before
training, every `train.eval_every` steps and after the last step (once: a last step that evaluated
already has); checkpoints every `train.save_every` steps.
With train.overlap the engines never stop: the next step's rollout starts before this step's batch
trains, and its weights reach the engines in flight; the step before a checkpoint and the last one drain
the rollout (`RolloutGroup.batch`). An engine that dies is restarted and caught up while the step goes on (driver/rollout.py); a learner rank
that dies stops the job with the checkpoint to resume from. `groups.jsonl` records where every group went.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import ray

from actors.metrics import DriverMetrics
from april_ray.tracking import Tracker, truncate_step_logs
from driver.checkpoint import restore_checkpoint, save_checkpoint
from driver.cluster import init_ray
from driver.engines import EngineGroup
from driver.evaluator import Evaluator
from driver.learners import LearnerGroup, stop_if_a_rank_dies
from driver.records import GroupLog, IdleShares, PhaseClock, staleness_metrics
from driver.rollout import RolloutGroup
from driver.output_dir import OutputLock
from driver.setup import open_output


def train(cfg) -> dict:
    """Run the job; returns the summary, with `history`: (training wall seconds, held-out accuracy)."""
    run = start_run(cfg)  # actors up; a resumed run restores its newest checkpoint
    engines, rollout, learners, evaluator, out = run.engines, run.rollout, run.learners, run.evaluator, run.out
    before = evaluator.run(run.version)
    exported = DriverMetrics(cfg.rollout)  # Ray's metrics (actors/metrics.py)
    exported.record_eval(before)
    tracker = Tracker(cfg, out, cfg.train.num_steps, run.start, resume=run.resumed)
    tracker.bar.write(f"held-out accuracy before: {json.dumps(before)}")
    records = GroupLog(out, cfg.staleness, fresh=not cfg.train.resume)
    t0 = time.perf_counter()
    train_s, history = 0.0, [(0.0, before["eval/accuracy_t1"])]  # training time excludes evaluation
    clock = PhaseClock()  # seconds per phase of each step, and over the run

    idle = IdleShares(busy_seconds(engines.stats(drain=False)))
    step, version, evaluated = run.start - 1, run.version, None
    for step in range(run.start, cfg.train.num_steps):
        clock.start()
        evaluated = None  # this step's held-out metrics, when it evaluates
        batch = rollout.batch(step, version, cfg.train)  # APRIL rollout, refs; overlapped: the next step's
        clock.mark("rollout")                           # rollout runs while this batch trains
        stats = engines.stats()
        metrics = batch.metrics | staleness_metrics(batch.staleness, cfg.staleness) | engines.occupancy_metrics(stats)
        with stop_if_a_rank_dies(out, step):
            metrics |= learners.train(batch.groups, version)             # ranks fetch their own shares
            clock.mark("learner")
            version += 1
            learners.publish(engines, version)  # engines adopt the new weights (overlapped: in flight)
            clock.mark("weight_sync")
        records.step(step, version - 1, batch)
        train_s += sum(clock.step.values())
        if (step + 1) % cfg.train.eval_every == 0:
            evaluated = evaluator.run(version)
            metrics |= evaluated
            clock.mark("eval")
            exported.record_eval(metrics)
            history.append((train_s, metrics["eval/accuracy_t1"]))
        metrics |= clock.metrics() | ray.get(rollout.store.stats.remote(version))
        metrics |= idle.metrics(busy_seconds(engines.stats(drain=False)), clock.totals)
        exported.record_step(step + 1, clock.step, metrics)
        tracker.log(step, metrics | {"train/version": version, "time/wall_s": time.perf_counter() - t0})
        if (step + 1) % cfg.train.save_every == 0:  # after the step's rows: a resume never lacks them
            save_checkpoint(out, run.lock.run, step, version, learners, rollout)

    after = evaluated  # the last step's evaluation is of the final weights already
    if after is None:
        after = evaluator.run(version)
        exported.record_eval(after)
        tracker.log(max(step, 0) + 1, after, advance=False)
        history.append((train_s, after["eval/accuracy_t1"]))
    idle_shares = idle.metrics(busy_seconds(engines.stats(drain=False)), clock.totals)
    records.end(step, ray.get(rollout.source.state_dict.remote()), ray.get(rollout.store.state_dict.remote()))
    if step >= run.start and (step + 1) % cfg.train.save_every:
        save_checkpoint(out, run.lock.run, step, version, learners, rollout)
    tracker.close()
    run.shutdown()
    return {"accuracy_before": before["eval/accuracy_t1"], "accuracy_after": after["eval/accuracy_t1"],
            "accuracy_before_greedy": before.get("eval/accuracy_greedy"),
            "accuracy_after_greedy": after.get("eval/accuracy_greedy"),
            "steps": cfg.train.num_steps - run.start, "wall_s": time.perf_counter() - t0,
            "final_version": version, "output_dir": str(out), "train_s": train_s, "history": history,
            "time_s": {f"{phase}_s": round(t, 3) for phase, t in clock.totals.items()},
            "engine_idle_fraction": idle_shares["job/engine_idle_fraction"],
            "learner_idle_fraction": idle_shares["job/learner_idle_fraction"]}


def busy_seconds(stats: list) -> list[float | None]:
    """Each engine's busy seconds from `EngineGroup.stats`, None for an engine that is down."""
    return [None if st is None else st.busy_s for st in stats]


@dataclasses.dataclass
class Run:
    """A job's actors and where it writes, as `start_run` brings them up."""
    out: Path
    engines: EngineGroup
    rollout: RolloutGroup
    learners: LearnerGroup
    evaluator: Evaluator
    start: int    # the first step to run
    version: int  # the policy version the engines serve
    resumed: bool
    lock: OutputLock  # train.output_dir, this job's alone until it ends

    def shutdown(self) -> None:
        for actors in (self.rollout, self.engines, self.learners):
            actors.shutdown()
        self.lock.release()


def start_run(cfg) -> Run:
    """Bring the job's actors up. A fresh run first moves an earlier run's files to runs/; a resumed run
    restores its newest checkpoint and drops the step rows logged after it (those steps are redone)."""
    output = open_output(cfg)  # held for this job alone; model, data and plan checked before a file moves
    out, job, ckpt = output.path, output.inputs, output.checkpoint
    if not ray.is_initialized():
        init_ray(job.layout, cfg.logging)

    # The engines load while the prompt source reads the dataset and the learner ranks set up, unless they
    # share GPUs: an engine sizes its KV cache from the memory free when it loads.
    engines = EngineGroup.start(cfg, job.model_path, job.layout, wait=job.layout.colocated)
    rollout = RolloutGroup.start(cfg, job.model_path, job.train_path, engines)
    learners = LearnerGroup(cfg, job.model_path, engines)
    engines.wait_loaded()
    engines.take_weights_from(learners.weights_ref)  # how a restarted engine is caught up
    evaluator = Evaluator(cfg, engines, job.model_path, job.eval_path)
    start, version = 0, 0
    if ckpt is not None:
        start, version = restore_checkpoint(ckpt, learners, rollout, engines)
        print(f"resumed from {ckpt}: step {start}, policy version {version}")
    if cfg.train.resume:
        truncate_step_logs(out, start - 1)
    return Run(out, engines, rollout, learners, evaluator, start, version, resumed=ckpt is not None,
               lock=output.lock)
