"""The learner ranks of a job: one `LearnerActor` per data-parallel rank, in the placement group's learner
bundles (or sharing the engines' bundles when colocated)."""
from __future__ import annotations

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.learner import LearnerActor
from april_ray.config import Config
from april_ray.placement import actor_resources


class LearnerGroup:
    def __init__(self, cfg: Config, model_path: str, engines):
        layout, pg = engines.layout, engines.placement_group
        self.actors = [
            LearnerActor.options(**actor_resources(layout, b),
                                 scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b)
                                 ).remote()
            for b in layout.learner_bundles
        ]
        master = ray.get(self.actors[0].rendezvous.remote())
        world = len(self.actors)
        mask_older_than = cfg.staleness.max_versions if cfg.staleness.policy == "mask" else -1
        ray.get([a.setup.remote(cfg.learner, cfg.algorithm, cfg.sampling.temperature, cfg.sampling.max_response_len,
                                mask_older_than, str(model_path), r, world, master)
                 for r, a in enumerate(self.actors)])
        self.model_path = str(model_path)

    def train(self, groups: list[list], version: int) -> dict[str, float]:
        """Whole groups go to one rank (advantages are per group); ranks fetch their own samples."""
        world = len(self.actors)
        shards = [[ref for g in groups[r::world] for ref in g] for r in range(world)]
        results = ray.get([a.train.remote(shard, version) for a, shard in zip(self.actors, shards)])
        return {k: sum(r[k] for r in results) / world for k in results[0]}

    def publish(self, engines, version: int) -> None:
        weights_ref = ray.get([a.publish.remote() for a in self.actors])[0]
        engines.publish(weights_ref, version)

    def save(self, path: str) -> None:
        ray.get([a.save.remote(path, self.model_path) for a in self.actors])

    def load(self, path: str) -> None:
        ray.get([a.load.remote(path) for a in self.actors])

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
