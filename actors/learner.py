"""Learner actors: one per data-parallel rank, placed in the learner bundles of the job's placement group.

The driver hands each rank the object refs of its share of the batch's groups; every rank fetches its
own samples (DESIGN-NOTES, item 9: no rank-0 funnel). After a step, rank 0 publishes the full weights
once (`ray.put`) and every engine adopts them from that one object.
"""
from __future__ import annotations

import socket

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.samples import fetch
from april_ray.config import Config
from april_ray.learner import Learner
from april_ray.placement import actor_resources


@ray.remote
class LearnerActor:
    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0 to host the process group."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, cfg: Config, model_path: str, rank: int, world_size: int, master: tuple[str, int]) -> None:
        import os

        os.environ["MASTER_ADDR"] = "127.0.0.1" if world_size == 1 else master[0]
        self.learner = Learner(model_path, cfg.learner, cfg.algorithm, cfg.rollout.temperature,
                               cfg.rollout.max_response_len, rank, world_size, master[1])

    def train(self, handles: list, version: int) -> dict:
        return self.learner.train_step(fetch(handles), version)

    def publish(self):
        return ray.put(self.learner.state_dict())

    def save(self, path: str, tokenizer_dir: str) -> None:
        self.learner.save(path, tokenizer_dir)

    def load(self, path: str) -> None:
        self.learner.load(path)


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
        ray.get([a.setup.remote(cfg, str(model_path), r, world, master) for r, a in enumerate(self.actors)])
        self.model_path = str(model_path)

    def train(self, groups: list[list], version: int) -> dict[str, float]:
        """Whole groups go to one rank (advantages are per group); ranks fetch their own samples."""
        world = len(self.actors)
        shards = [[ref for g in groups[r::world] for ref in g] for r in range(world)]
        results = ray.get([a.train.remote(shard, version) for a, shard in zip(self.actors, shards)])
        return {k: sum(r[k] for r in results) / world for k in results[0]}

    def publish(self, engines, version: int) -> None:
        engines.publish(ray.get(self.actors[0].publish.remote()), version)

    def save(self, path: str) -> None:
        ray.get([a.save.remote(path, self.model_path) for a in self.actors])

    def load(self, path: str) -> None:
        ray.get([a.load.remote(path) for a in self.actors])

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
