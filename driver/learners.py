"""The learner ranks of a job: one `LearnerActor` per data-parallel rank, in the placement group's learner
bundles (or sharing the engines' bundles when colocated).

A publish hands the ranks the engines' servers; each rank sends its weights through the job's one channel
(`april_ray.weights`, chosen once per rank) and the engines adopt what was delivered
(`EngineGroup.adopt`). An engine that is dead or restarting is left out and the job goes on: only a
learner's own death is a learner death (driver/restore.py restores the job in place). An engine left out is brought to the published weights through
the object store once it answers (`EngineGroup.catch_up`, from `LearnerGroup.weights_ref`).
"""
from __future__ import annotations

import logging

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.learner import LearnerActor
from april_ray.config import Config
from april_ray.placement import actor_resources
from driver.engines import disk_weights_dir

log = logging.getLogger(__name__)


# OpenMP threads that sleep at a barrier instead of spinning: on CPU cores shared with the engines (or with
# other jobs) a spinning thread burns the time slice its partner needs, and 2-thread steps of the tiny model
# took 20-40x longer than 1-thread ones (BENCHMARKS.md, step breakdown). Set before torch loads in the actor.
LEARNER_ENV = {"env_vars": {"OMP_WAIT_POLICY": "PASSIVE"}}


class LearnerGroup:
    def __init__(self, cfg: Config, model_path: str, engines):
        layout, pg = engines.layout, engines.placement_group
        self.actors = [
            LearnerActor.options(**actor_resources(layout, b), runtime_env=LEARNER_ENV,
                                 scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b)
                                 ).remote()
            for b in layout.learner_bundles
        ]
        master = ray.get(self.actors[0].rendezvous.remote())
        world = len(self.actors)
        ray.get([a.setup.remote(cfg.learner, cfg.algorithm, cfg.sampling.temperature, cfg.sampling.max_response_len,
                                cfg.staleness, str(model_path), r, world, master, cfg.engine, disk_weights_dir(cfg),
                                cfg.train.seed)
                 for r, a in enumerate(self.actors)])
        self.model_path = str(model_path)
        self.engines = engines

    def train(self, groups: list[list], version: int) -> dict[str, float]:
        """Whole groups go to one rank (advantages are per group); ranks fetch their own samples."""
        self.engines.make_room_for_learner()
        world = len(self.actors)
        shards = [[ref for g in groups[r::world] for ref in g] for r in range(world)]
        results = ray.get([a.train.remote(shard, version) for a, shard in zip(self.actors, shards)])
        return {k: max(r[k] for r in results) if k.endswith("_max") else sum(r[k] for r in results)
                / (1 if k == "train/num_samples" else world) for k in results[0]}

    def weights_ref(self):
        """The ranks' current weights in the object store: every rank gathers (ZeRO-3), rank 0 puts them once."""
        return ray.get([a.put_weights.remote() for a in self.actors])[0]

    def publish(self, engines, version: int) -> None:
        """Every engine serves the ranks' current weights as `version` when this returns (or is left out,
        to be caught up once it answers)."""
        access = engines.open_for_weights()
        servers = [None if a is None else a.server for a in access]
        engines.adopt(access, ray.get([a.send_weights.remote(servers, version) for a in self.actors]), version)

    def save(self, path: str) -> None:
        ray.get([a.save.remote(path, self.model_path) for a in self.actors])

    def load(self, path: str) -> None:
        ray.get([a.load.remote(path) for a in self.actors])

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
