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
    ahead: dict = field(default_factory=dict)
    """Overlapped mode: the rollout step asked for before its turn, by step."""

    @classmethod
    def start(cls, cfg: Config, model_path: str, train_path: str, engines: EngineGroup) -> "RolloutGroup":
        source = start_source(cfg, model_path, train_path)
        ray.get(source.num_groups_taken.remote())  # a bad dataset row stops the job here, named by file and line
        store = StoreActor.remote(cfg.staleness)
        return cls(source, store, start_monitor(cfg, engines, source, store), engines)

    def step(self, step: int, version: int, keep_running: bool = False):
        """One rollout step, started and waited for: a `StepResult` of sample refs."""
        return self.result(self.begin(step, version, keep_running))

    def batch(self, step: int, version: int, train: TrainConfig):
        """The batch `step` trains at `version`. Overlapped (train.overlap, unless a checkpoint or the end
        follows `step`): the next step's rollout is asked for before this batch is waited for, so it runs
        while this batch trains, and it goes on with this step's running groups. One step ahead, no more:
        the batch after it is asked for only once this one trains, and a step that ends with none asked
        after it stops its groups (`CompletionMonitor.step`), so the engines never generate for a batch
        more than one version ahead of the learner; what spills over into later steps is held to
        staleness.max_versions per token when trained. (A deeper look-ahead kept the engines as busy on
        two shared cores and masked up to 87% of a batch's tokens as too old: BENCHMARKS.md.)"""
        started = self.ahead.pop(step, None) or self.begin(step, version, overlaps(train, step))
        if overlaps(train, step):
            self.ahead[step + 1] = self.begin(step + 1, version + 1, overlaps(train, step + 1), after=step)
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


def overlaps(train: TrainConfig, step: int) -> bool:
    """Whether `step`'s rollout leaves its unfinished groups running into the next one (train.overlap): not
    on the step before a checkpoint (a checkpoint holds every group taken: returned, dropped or stored),
    nor on the last."""
    return train.overlap and (step + 1) % train.save_every != 0 and step < train.num_steps - 1
