"""The rollout of a job: prompt source, partial-rollout store and completion monitor over the engines of
an `EngineGroup`, and the driver's side of a rollout step (`step`), which also hands engines that died
and came back to the running step."""
from __future__ import annotations

from dataclasses import dataclass, field

import ray

from actors.monitor import CompletionMonitorActor
from actors.prompt_source import PromptSourceActor
from actors.store import StoreActor
from april_ray.config import Config, TrainConfig, run_seeded
from driver.engines import EngineGroup


@dataclass
class RolloutGroup:
    source: object
    store: object
    monitor: object
    engines: EngineGroup
    run_id: str
    """The monitor's step tokens are (run_id, step): what `abandon` closes on the engines once it is gone."""
    ahead: dict = field(default_factory=dict)
    """Overlapped mode: the rollout step asked for before its turn, by step."""

    @classmethod
    def start(cls, cfg: Config, model_path: str, train_path: str, engines: EngineGroup) -> "RolloutGroup":
        source = start_source(cfg, model_path, train_path)
        ray.get(source.num_groups_taken.remote())  # a bad dataset row stops the job here, named by file and line
        store = StoreActor.remote(cfg.staleness)
        monitor = start_monitor(cfg, engines, source, store)
        return cls(source, store, monitor, engines, ray.get(monitor.run_id.remote()))

    def step(self, step: int, version: int, keep_running: bool = False):
        """One rollout step, started and waited for: a `StepResult` of sample refs."""
        return self.result(self.begin(step, version, keep_running))

    def batch(self, step: int, version: int, train: TrainConfig):
        """The batch `step` trains at `version`. Overlapped (train.overlap): before this batch is waited for,
        the steps up to train.overlap_ahead beyond it are asked for (`asked_ahead`), each to be trained one
        version after the one before it, so they run while this batch trains and go on with the running
        groups. No further: the step after them is asked for only once this batch trains, and a step that
        ends with none asked after it stops its groups (`CompletionMonitor.step`), so the engines never
        generate for a batch more than overlap_ahead versions ahead of the learner; what spills over into
        later steps is held to staleness.max_versions per token when trained. (Four steps ahead masked
        55-72% of the trained tokens as too old, late accuracy 7.4 points below sync's, hence one by
        default: BENCHMARKS.md.)"""
        started = self.ahead.pop(step, None) or self.begin(step, version, overlaps(train, step))
        for later in asked_ahead(train, step):
            if later not in self.ahead:
                self.ahead[later] = self.begin(later, version + later - step, overlaps(train, later), after=later - 1)
        return self.result(started)

    def begin(self, step: int, version: int, keep_running: bool = False, after: int | None = None):
        """Start a rollout step whose batch is trained at `version` (the overlapped mode starts the next one
        while the learner trains); `keep_running` leaves its unfinished groups generating after it returns;
        `after`: the step asked just before, which the monitor runs first whichever call reaches it first."""
        return self.monitor.step.remote(step, version, keep_running, after), step

    def result(self, started, poll_s: float = 1.0):
        """The started step's `StepResult`. Meanwhile the driver waits on the monitor to say an engine was
        lost; while any is, it tries every `poll_s` to catch it up once Ray has restarted it, and hands it
        back, so a step goes on (or, with every engine dead, resumes) without waiting for its end."""
        ref, step = started
        while not ray.wait([ref], timeout=0)[0]:
            dead = ray.get(self.monitor.dead_engines.remote([], step))  # returns at a death, or the step's end
            back = self.engines.catch_up(dead, wait_s=poll_s) if dead else []
            if back:
                ray.get(self.monitor.revive.remote(back))
            elif dead:
                ray.wait([ref], timeout=poll_s)
        return ray.get(ref)

    def abandon(self, first_step: int, last_step: int, timeout_s: float = 30) -> None:
        """Stop on the engines every call this rollout's monitor sent for steps `first_step`..`last_step`
        (and those asked ahead): their step tokens closed, so none of them starts again, and every request
        aborted. The monitor is gone or being replaced: nobody would collect what they generate."""
        last = max([last_step + 1, *self.ahead])
        tokens = [(self.run_id, s) for s in range(first_step, last + 1)]
        calls = [a.abort_all.remote(t) for a in self.engines.actors for t in tokens]
        calls += [a.abort_engine.remote() for a in self.engines.actors]
        ray.wait(calls, num_returns=len(calls), timeout=timeout_s)  # a dead engine's fail: it runs nothing

    def shutdown(self) -> None:
        for actor in (self.source, self.store, self.monitor):
            ray.kill(actor)


def start_source(cfg: Config, model_path: str, train_path: str):
    """The prompt source of `cfg`'s rollout: the dataset in the run's seeded order, each prompt fitted to
    the context the responses leave."""
    return PromptSourceActor.remote(train_path, cfg.task, str(model_path), cfg.rollout.n_samples_per_prompt,
                                    cfg.sampling.max_response_len, run_seeded(cfg.task.seed, cfg.train.seed),
                                    cfg.engine.max_model_len - cfg.sampling.max_response_len)


def start_monitor(cfg: Config, engines: EngineGroup, source, store):
    """The completion monitor of `cfg`'s rollout over `engines`, drawing from `source` and `store`."""
    return CompletionMonitorActor.remote(cfg.rollout, cfg.staleness, engines.actors, engines.capacities, source,
                                         store, reward_per_group=cfg.task.reward_per_group)


def asked_ahead(train: TrainConfig, step: int) -> list[int]:
    """The steps asked for before `step`'s batch is waited for: up to train.overlap_ahead beyond it, each
    while the step before it keeps its groups running (`overlaps`), so never past the step before a
    checkpoint nor past the last; none outside the overlapped mode."""
    later = []
    for ahead in range(step + 1, step + 1 + train.overlap_ahead):
        if not overlaps(train, ahead - 1):
            break
        later.append(ahead)
    return later


def overlaps(train: TrainConfig, step: int) -> bool:
    """Whether `step`'s rollout leaves its unfinished groups running into the next one (train.overlap): not
    on the step before a checkpoint (a checkpoint holds every group taken: returned, dropped or stored),
    nor on the last."""
    return train.overlap and (step + 1) % train.save_every != 0 and step < train.num_steps - 1
