"""The rollout of a job: prompt source, partial-rollout store and completion monitor over the engines of
an `EngineGroup`, and the driver's side of a rollout step (`step`), which also hands engines that died
and came back to the running step."""
from __future__ import annotations

from dataclasses import dataclass, field

import ray

from actors.monitor import CompletionMonitorActor
from actors.prompt_source import PromptSourceActor
from actors.store import StoreActor
from april_ray.config import Config, StalenessConfig, TrainConfig, run_seeded
from driver.engines import EngineGroup


@dataclass
class RolloutGroup:
    source: object
    store: object
    monitor: object
    engines: EngineGroup
    ahead: dict = field(default_factory=dict)
    """Overlapped mode: the rollout steps asked for before their turn, by step."""

    @classmethod
    def start(cls, cfg: Config, model_path: str, train_path: str, engines: EngineGroup) -> "RolloutGroup":
        source = PromptSourceActor.remote(train_path, cfg.task, str(model_path), cfg.rollout.n_samples_per_prompt,
                                          cfg.sampling.max_response_len,
                                          run_seeded(cfg.task.seed, cfg.train.seed),  # the prompt order
                                          cfg.engine.max_model_len - cfg.sampling.max_response_len)
        ray.get(source.num_groups_taken.remote())  # a bad dataset row stops the job here, named by file and line
        store = StoreActor.remote(cfg.staleness)
        monitor = CompletionMonitorActor.remote(cfg.rollout, cfg.staleness, engines.actors, engines.capacities, source,
                                                 store, reward_per_group=cfg.task.reward_per_group)
        return cls(source, store, monitor, engines)

    def step(self, step: int, version: int, keep_running: bool = False):
        """One rollout step, started and waited for: a `StepResult` of sample refs."""
        return self.result(self.begin(step, version, keep_running))

    def batch(self, step: int, version: int, train: TrainConfig, staleness: StalenessConfig):
        """The batch `step` trains at `version`. Overlapped (train.overlap): the rollouts of the steps after
        it are asked for too, as far as their tokens stay within the staleness bound when trained (the
        engines serve `version` or later from now on, and each step trains one version later) and no step
        before a checkpoint is passed; they run while this batch trains. The last step asked stops its
        groups when it ends, unless the next one was asked meanwhile (`CompletionMonitor.step`)."""
        started = self.ahead.pop(step, None) or self.begin(step, version, overlaps(train, step))
        ahead = step
        while overlaps(train, ahead) and ahead - step < max(1, staleness.max_versions):
            ahead += 1
            if ahead not in self.ahead:
                self.ahead[ahead] = self.begin(ahead, version + ahead - step, overlaps(train, ahead))
        return self.result(started)

    def begin(self, step: int, version: int, keep_running: bool = False):
        """Start a rollout step whose batch is trained at `version` (the overlapped mode starts the next one
        while the learner trains); `keep_running` leaves its unfinished groups generating after it returns."""
        return self.monitor.step.remote(step, version, keep_running), step

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


def overlaps(train: TrainConfig, step: int) -> bool:
    """Whether `step`'s rollout leaves its unfinished groups running into the next one (train.overlap): not
    on the step before a checkpoint (a checkpoint holds every group taken: returned, dropped or stored),
    nor on the last."""
    return train.overlap and (step + 1) % train.save_every != 0 and step < train.num_steps - 1
