"""The training job's driver: the algorithm, step by step (`python -m jobs.train` runs it).

Each step: an APRIL rollout (over-provision, interrupt, recycle) returns N complete groups as object
refs; the learner ranks fetch their shares and take one optimiser step; the new weights are published
once and every engine adopts them under the next policy version. Held-out accuracy is evaluated before
training, every `train.eval_every` steps and after the last step (once: a last step that evaluated
already has); checkpoints every `train.save_every` steps.
With train.overlap the engines never stop: the next step's rollout starts before this step's batch
trains, and its weights reach the engines in flight; the step before a checkpoint and the last one drain
the rollout (`RolloutGroup.batch`). An engine that dies is restarted and caught up while the step goes on (driver/rollout.py); any other
actor that dies (a learner rank, the monitor, the store, the source) is restored in place to the newest
checkpoint while the engines keep running, and the loop redoes the steps after it (driver/restore.py).
`groups.jsonl` records where every group went.
"""
from __future__ import annotations

import json
import time

import ray

from actors.metrics import DriverMetrics
from april_ray.tracking import Tracker
from driver.checkpoint import save_checkpoint
from driver.evaluator import EvalHistory
from driver.records import GroupLog, IdleShares, PhaseClock, staleness_metrics
from driver.restore import Restorer
from driver.setup import start_run


def train(cfg) -> dict:
    """Run the job; returns the summary, with `history`: (training wall seconds, held-out accuracy)."""
    run = start_run(cfg)  # actors up; a resumed run restores its newest checkpoint
    engines, evaluator, out = run.engines, run.evaluator, run.out  # run.rollout, run.learners: a restore replaces them
    before = evaluator.run(run.version)
    exported = DriverMetrics(cfg.rollout)  # Ray's metrics (actors/metrics.py)
    exported.record_eval(before)
    tracker = Tracker(cfg, out, cfg.train.num_steps, run.start, resume=run.resumed)
    tracker.bar.write(f"held-out accuracy before: {json.dumps(before)}")
    records = GroupLog(out, cfg.staleness, fresh=not cfg.train.resume)
    restorer = Restorer(cfg, run, tracker)  # an actor's death: back to the newest checkpoint, engines kept
    t0 = time.perf_counter()
    train_s, history = 0.0, EvalHistory()  # training time excludes evaluation
    history.add(run.start, 0.0, before["eval/accuracy_t1"])
    clock = PhaseClock()  # seconds per phase of each step, and over the run

    idle = IdleShares(busy_seconds(engines.stats(drain=False)))
    step, version, evaluated = run.start, run.version, None
    while step <= cfg.train.num_steps:  # the pass after the last step closes the records
        try:
            if step == cfg.train.num_steps:
                finish(cfg, run, records, step - 1, version)
                break
            clock.start()
            evaluated = None  # this step's held-out metrics, when it evaluates
            batch = run.rollout.batch(step, version, cfg.train)  # APRIL rollout, refs; overlapped: the next
            clock.mark("rollout")                               # step's rollout runs while this batch trains
            stats = engines.stats()
            metrics = batch.metrics | staleness_metrics(batch.staleness, cfg.staleness) | engines.occupancy_metrics(stats)
            metrics |= run.learners.train(batch.groups, version)             # ranks fetch their own shares
            clock.mark("learner")
            run.learners.publish(engines, version + 1)  # engines adopt the new weights (overlapped: in flight)
            version += 1
            clock.mark("weight_sync")
            records.step(step, version - 1, batch)
            train_s += sum(clock.step.values())
            if (step + 1) % cfg.train.eval_every == 0:
                evaluated = evaluator.run(version)
                metrics |= evaluated
                clock.mark("eval")
                exported.record_eval(metrics)
                history.add(step + 1, train_s, metrics["eval/accuracy_t1"])
            metrics |= clock.metrics() | ray.get(run.rollout.store.stats.remote(version))
            metrics |= idle.metrics(busy_seconds(engines.stats(drain=False)), clock.totals)
            exported.record_step(step + 1, clock.step, metrics)
            tracker.log(step, metrics | {"train/version": version, "time/wall_s": time.perf_counter() - t0})
            if (step + 1) % cfg.train.save_every == 0:  # after the step's rows: a resume never lacks them
                save_checkpoint(out, run.lock.run, step, version, run.learners, run.rollout)
                clock.mark("checkpoint")  # its seconds in the summary's time_s
            step += 1
        except Exception as e:  # a learner rank, the monitor, the store or the source died: re-raised if none
            step, version = restorer.restore(e, step)

    step = cfg.train.num_steps - 1
    after = evaluated  # the last step's evaluation is of the final weights already
    if after is None:
        after = evaluator.run(version)
        exported.record_eval(after)
        tracker.log(max(step, 0) + 1, after, advance=False)
        history.add(step + 1, train_s, after["eval/accuracy_t1"])
    idle_shares = idle.metrics(busy_seconds(engines.stats(drain=False)), clock.totals)
    tracker.close()
    run.shutdown()
    return {"accuracy_before": before["eval/accuracy_t1"], "accuracy_after": after["eval/accuracy_t1"],
            "accuracy_before_greedy": before.get("eval/accuracy_greedy"),
            "accuracy_after_greedy": after.get("eval/accuracy_greedy"),
            "steps": cfg.train.num_steps - run.start, "wall_s": time.perf_counter() - t0,
            "final_version": version, "output_dir": str(out), "train_s": train_s, "history": history.points(),
            "time_s": {f"{phase}_s": round(t, 3) for phase, t in clock.totals.items()},
            "engine_idle_fraction": idle_shares["job/engine_idle_fraction"],
            "learner_idle_fraction": idle_shares["job/learner_idle_fraction"],
            "restores": restorer.num_restores}


def finish(cfg, run, records: GroupLog, step: int, version: int) -> None:
    """The last row of `groups.jsonl` (the cursor and the store's groups) and the last checkpoint, unless
    the last step saved one."""
    rollout = run.rollout
    records.end(step, ray.get(rollout.source.state_dict.remote()), ray.get(rollout.store.state_dict.remote()))
    if step >= run.start and (step + 1) % cfg.train.save_every:
        save_checkpoint(run.out, run.lock.run, step, version, run.learners, rollout)


def busy_seconds(stats: list) -> list[float | None]:
    """Each engine's busy seconds from `EngineGroup.stats`, None for an engine that is down."""
    return [None if st is None else st.busy_s for st in stats]
