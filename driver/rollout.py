"""The rollout actors of a job: prompt source, partial-rollout store and completion monitor, over the
engines of an `EngineGroup`."""
from __future__ import annotations

from dataclasses import dataclass

import ray

from actors.monitor import CompletionMonitorActor
from actors.prompt_source import PromptSourceActor
from actors.store import StoreActor
from april_ray.config import Config


@dataclass
class RolloutGroup:
    source: object
    store: object
    monitor: object

    @classmethod
    def start(cls, cfg: Config, model_path: str, train_path: str, engines) -> "RolloutGroup":
        source = PromptSourceActor.remote(train_path, cfg.task.prompt_key, cfg.task.answer_key, str(model_path),
                                          cfg.rollout.n_samples_per_prompt, cfg.sampling.max_response_len,
                                          cfg.task.seed + 7919 * cfg.train.seed,  # the prompt order
                                          cfg.engine.max_model_len - cfg.sampling.max_response_len,
                                          cfg.task.overlong_prompts)
        ray.get(source.num_groups_taken.remote())  # a bad dataset row stops the job here, named by file and line
        store = StoreActor.remote(cfg.staleness)
        monitor = CompletionMonitorActor.remote(cfg.rollout, engines.actors, engines.capacities, source, store)
        return cls(source, store, monitor)

    def shutdown(self) -> None:
        for actor in (self.source, self.store, self.monitor):
            ray.kill(actor)
