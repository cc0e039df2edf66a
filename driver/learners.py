"""The learner ranks of a job: one `LearnerActor` per data-parallel rank, in the placement group's learner
bundles (or sharing the engines' bundles when colocated), and how their weights reach the engines
(`engine.weight_sync`, one class each, chosen once).
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import ray
from ray.exceptions import OutOfMemoryError, RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.learner import LearnerActor
from april_ray.config import Config
from april_ray.placement import actor_resources
from driver.checkpoint import named_by_latest


# OpenMP threads that sleep at a barrier instead of spinning: on CPU cores shared with the engines (or with
# other jobs) a spinning thread burns the time slice its partner needs, and 2-thread steps of the tiny model
# took 20-40x longer than 1-thread ones (BENCHMARKS.md, step breakdown). Set before torch loads in the actor.
LEARNER_ENV = {"env_vars": {"OMP_WAIT_POLICY": "PASSIVE"}}


class LearnerDied(RuntimeError):
    pass


def learner_died(out: Path, step: int, error: Exception) -> LearnerDied:
    """The policy and optimiser state since the last checkpoint live only in the ranks (a surviving ZeRO
    rank holds a part of the optimiser state, and its collectives would wait for the dead one), so no
    newer consistent checkpoint can be written: the last one, with its store and cursor, is where to go on."""
    ckpt = named_by_latest(out)
    where = f"from {ckpt}" if ckpt else "from the start (no checkpoint yet)"
    return LearnerDied(f"step {step}: a learner rank died ({type(error).__name__}: {str(error)[:300]}). The job "
                       f"stops; `train.resume=true` goes on {where}, redoing the steps after it")


@contextmanager
def stop_if_a_rank_dies(out: Path, step: int):
    """A learner rank's process that dies (or Ray's OOM killer ends) stops the job with `LearnerDied`."""
    try:
        yield
    except (RayActorError, OutOfMemoryError) as e:
        raise learner_died(out, step, e) from e


def weights_in_object_store(learners: list):
    """The ranks' current weights in the object store: every rank gathers (ZeRO-3), rank 0 puts them once."""
    return ray.get([a.publish.remote() for a in learners])[0]


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
        mask_older_than = cfg.staleness.mask_older_than
        ray.get([a.setup.remote(cfg.learner, cfg.algorithm, cfg.sampling.temperature, cfg.sampling.max_response_len,
                                mask_older_than, str(model_path), r, world, master, cfg.train.seed)
                 for r, a in enumerate(self.actors)])
        self.model_path = str(model_path)
        self.sync = WEIGHT_SYNC[cfg.engine.weight_sync](self.actors, engines, cfg, self.model_path)
        engines.weights_source = self.weights_ref  # a restarted engine is caught up from the object store

    def train(self, groups: list[list], version: int) -> dict[str, float]:
        """Whole groups go to one rank (advantages are per group); ranks fetch their own samples."""
        self.sync.before_train()
        world = len(self.actors)
        shards = [[ref for g in groups[r::world] for ref in g] for r in range(world)]
        results = ray.get([a.train.remote(shard, version) for a, shard in zip(self.actors, shards)])
        return {k: max(r[k] for r in results) if k.endswith("_max") else sum(r[k] for r in results)
                / (1 if k == "train/num_samples" else world) for k in results[0]}

    def weights_ref(self):
        return weights_in_object_store(self.actors)

    def publish(self, engines, version: int) -> None:
        """Every engine serves the ranks' current weights as `version` when this returns."""
        self.sync.publish(version)

    def save(self, path: str) -> None:
        ray.get([a.save.remote(path, self.model_path) for a in self.actors])

    def load(self, path: str) -> None:
        ray.get([a.load.remote(path) for a in self.actors])

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)


class ObjectStoreSync:
    """Rank 0 puts the full weights in the object store once; every engine adopts them from that one
    object (an HTTP engine hands them on to its server from its own process). Every rank gathers: ZeRO-3
    partitions need all of them."""

    def __init__(self, learners: list, engines, cfg, model_path: str):
        self.learners, self.engines = learners, engines
        self.flush_cache = not cfg.engine.reuse_stale_kv
        """Servers drop their prefix caches with an update unless stale caches may be reused."""
        self.bucket_mb = cfg.engine.weight_bucket_mb

    def before_train(self) -> None:
        pass

    def publish(self, version: int) -> None:
        self.engines.publish(weights_in_object_store(self.learners), version)


class BroadcastSync(ObjectStoreSync):
    """Disaggregated servers: rank 0 broadcasts into every server (NCCL on GPUs, gloo with our CPU
    server), metadata over HTTP; the engines then stamp new tokens with the version."""

    def __init__(self, learners: list, engines, cfg, model_path: str):
        super().__init__(learners, engines, cfg, model_path)
        self.backend = "gloo" if cfg.engine.server == "cpu" else "nccl"
        self.tp_size = cfg.engine.tp_size
        """Each server's tensor-parallel ranks join the group (ranks 1 + i x tp_size ...)."""

    def publish(self, version: int) -> None:
        urls = self.engines.urls()
        ray.get([a.broadcast_weights.remote(urls, version, self.flush_cache, self.bucket_mb, self.backend,
                                            self.tp_size)
                 for a in self.learners])
        self.engines.publish(None, version)


class TensorSync(ObjectStoreSync):
    """Colocated servers: they give their GPU memory back while the ranks train; then each rank hands its
    weights by handle (CUDA IPC) to the server on its own GPU, and the KV cache comes back for rollout."""

    def __init__(self, learners: list, engines, cfg, model_path: str):
        super().__init__(learners, engines, cfg, model_path)
        self.released = False

    def before_train(self) -> None:
        self.engines.release_memory(["weights", "kv_cache", "cuda_graph"])
        self.released = True

    def publish(self, version: int) -> None:
        if self.released:
            self.engines.resume_memory(["weights"])
        urls, world = self.engines.urls(), len(self.learners)
        ray.get([a.hand_over_weights.remote(urls[r::world], version, self.flush_cache, self.bucket_mb)
                 for r, a in enumerate(self.learners)])
        if self.released:
            self.engines.resume_memory(["kv_cache", "cuda_graph"])
            self.released = False
        self.engines.publish(None, version)


class DiskSync(ObjectStoreSync):
    """Rank 0 writes a safetensors directory (train.output_dir/weights, on storage every node sees) and
    every server loads it."""

    def __init__(self, learners: list, engines, cfg, model_path: str):
        super().__init__(learners, engines, cfg, model_path)
        self.path, self.model_path = str(Path(cfg.train.output_dir).resolve() / "weights"), model_path

    def publish(self, version: int) -> None:
        urls = self.engines.urls()
        ray.get([a.weights_to_disk.remote(self.path, self.model_path, urls, version, self.flush_cache)
                 for a in self.learners])
        self.engines.publish(None, version)


WEIGHT_SYNC = {"object_store": ObjectStoreSync, "broadcast": BroadcastSync, "tensor": TensorSync, "disk": DiskSync}
