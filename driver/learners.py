"""The learner ranks of a job: one `LearnerActor` per data-parallel rank, in the placement group's learner
bundles (or sharing the engines' bundles when colocated), and how their weights reach the engines
(`engine.weight_sync`, one class each, chosen once).

On every channel a publish that meets an engine that is dead or restarting leaves it out, and the job goes
on: only a learner's own death is a learner death. An engine left out is brought to the published weights
through the object store once it answers (`EngineGroup.catch_up`), as under the object-store channel.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

import ray
from ray.exceptions import OutOfMemoryError, RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.learner import LearnerActor
from april_ray.config import Config
from april_ray.placement import actor_resources
from driver.checkpoint import named_by_latest
from driver.engines import disk_weights_dir, settle

log = logging.getLogger(__name__)


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
        ray.get([a.setup.remote(cfg.learner, cfg.algorithm, cfg.sampling.temperature, cfg.sampling.max_response_len,
                                cfg.staleness, str(model_path), r, world, master, cfg.train.seed)
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
        access = server_access(self.engines)
        servers = [s for s in servers_of(access) if s is not None]
        received = ray.get([a.broadcast_weights.remote(servers, version, self.flush_cache, self.bucket_mb,
                                                       self.backend, self.tp_size)
                            for a in self.learners])
        adopt(self.engines, access, set().union(*received), version)


class TensorSync(ObjectStoreSync):
    """Colocated servers: they give their GPU memory back while the ranks train; then each rank hands its
    weights by handle (CUDA IPC) to the server on its own GPU, and the KV cache comes back for rollout."""

    def __init__(self, learners: list, engines, cfg, model_path: str):
        super().__init__(learners, engines, cfg, model_path)
        self.released = False

    def before_train(self) -> None:
        engine_calls(self.engines, "release_memory", ["weights", "kv_cache", "cuda_graph"])
        self.released = True

    def publish(self, version: int) -> None:
        if self.released:
            engine_calls(self.engines, "resume_memory", ["weights"])
        access, world = server_access(self.engines), len(self.learners)
        servers = servers_of(access)
        received = ray.get([a.hand_over_weights.remote([s for s in servers[r::world] if s is not None], version,
                                                       self.flush_cache, self.bucket_mb)
                            for r, a in enumerate(self.learners)])
        if self.released:
            engine_calls(self.engines, "resume_memory", ["kv_cache", "cuda_graph"])
            self.released = False
        adopt(self.engines, access, set().union(*received), version)


class DiskSync(ObjectStoreSync):
    """Rank 0 writes a safetensors directory (train.output_dir/weights, on storage every node sees) and
    every server loads it."""

    def __init__(self, learners: list, engines, cfg, model_path: str):
        super().__init__(learners, engines, cfg, model_path)
        self.path, self.model_path = disk_weights_dir(cfg), model_path

    def publish(self, version: int) -> None:
        access = server_access(self.engines)
        servers = [s for s in servers_of(access) if s is not None]
        received = ray.get([a.weights_to_disk.remote(self.path, self.model_path, servers, version, self.flush_cache)
                            for a in self.learners])
        adopt(self.engines, access, set().union(*received), version)


def server_access(engines) -> list[tuple[str, str, str] | None]:
    """Each engine's (server URL, admin key, incarnation); None for an engine that is down."""
    got = settle([a.server_access.remote() for a in engines.actors], timeout_s=60.0)
    return [None if isinstance(g, Exception) else tuple(g) for g in got]


def servers_of(access: list) -> list[tuple[str, str] | None]:
    """What a learner needs of each server: (URL, admin key), None where the engine is down."""
    return [None if a is None else a[:2] for a in access]


def adopt(engines, access: list, received: set[str], version: int, wait_s: float = 5.0) -> None:
    """The engines whose server loaded the weights of `version` serve it from now on (unless restarted since:
    the incarnation is checked). The others are caught up from the object store now if they answer, else
    by the rollout step once they are back."""
    engines.weights = (None, version)
    got = [e for e, a in enumerate(access) if a is not None and a[0] in received]
    done = settle([engines.actors[e].update_weights.remote(None, version, access[e][2]) for e in got])
    adopted = {e for e, out in zip(got, done) if not isinstance(out, Exception)}
    for e, out in zip(got, done):
        if e in adopted:
            engines.saw(e, out["incarnation"])  # a restart that no step saw is counted here
    missed = [e for e in range(len(access)) if e not in adopted]
    if missed:
        log.warning("engines %s missed the weights of version %d: caught up once they answer", missed, version)
        engines.catch_up(missed, wait_s)


def engine_calls(engines, method: str, *args) -> None:
    """One call to every engine; one that is down is skipped (it is caught up once back)."""
    settle([getattr(a, method).remote(*args) for a in engines.actors], timeout_s=60.0)


WEIGHT_SYNC = {"object_store": ObjectStoreSync, "broadcast": BroadcastSync, "tensor": TensorSync, "disk": DiskSync}
