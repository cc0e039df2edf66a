"""The engines of a job: the placement group (owned here), one `EngineWorkerActor` per engine bundle,
weight publishing and engine statistics.

Engines are started once and outlive a rollout configuration, so benchmarks can compare modes on the
very same engines and data.
"""
from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.engine_worker import EngineWorkerActor
from april_ray.config import Config
from april_ray.placement import Layout, actor_resources


@dataclass
class EngineGroup:
    actors: list
    capacities: list[int]
    placement_group: object
    layout: Layout
    """The placement plan; learner ranks go into its learner bundles."""

    @classmethod
    def start(cls, cfg: Config, model_path: str, layout: Layout, version: int = 0,
              timeout_s: float = 300) -> "EngineGroup":
        check_resources(layout)
        pg = placement_group(layout.bundles, strategy=layout.strategy)
        if not pg.wait(timeout_s):
            raise RuntimeError(f"placement group {layout.bundles} ({layout.strategy}) could not be placed within "
                               f"{timeout_s:.0f}s; cluster resources: {ray.cluster_resources()}")
        actors = [
            EngineWorkerActor.options(
                **actor_resources(layout, b),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b),
            ).remote(cfg.engine, cfg.sampling, cfg.staleness, cfg.task.name, str(model_path), version, index)
            for index, b in enumerate(layout.engine_bundles)
        ]
        ray.get([e.stats.remote() for e in actors])  # loaded and serving
        return cls(actors, [cfg.engine.max_num_seqs] * len(actors), pg, layout)

    def publish(self, weights_ref, version: int) -> None:
        """Every engine adopts the weights behind one object ref (one `ray.put`, no per-engine copies);
        `None`: the weights reached the servers by another channel, only the version is new."""
        ray.get([e.update_weights.remote(weights_ref, version) for e in self.actors])

    def urls(self) -> list[str]:
        """engine.backend=sglang: each engine's server, in engine order."""
        return ray.get([e.server_url.remote() for e in self.actors])

    def release_memory(self, tags: list[str]) -> None:
        """Colocated servers give GPU memory back (weights, kv_cache, cuda_graph) while the learner trains."""
        ray.get([e.release_memory.remote(tags) for e in self.actors])

    def resume_memory(self, tags: list[str]) -> None:
        ray.get([e.resume_memory.remote(tags) for e in self.actors])

    def stats(self, drain: bool = True):
        return ray.get([e.stats.remote(drain) for e in self.actors])

    def occupancy_metrics(self) -> dict[str, float]:
        """Running-batch occupancy since the last call (mean over decode steps, as a fraction of the cap)."""
        stats = self.stats(drain=True)
        points = [n / cap for st, cap in zip(stats, self.capacities) for _, n in st.occupancy]
        return {"engine/occupancy_mean": sum(points) / max(1, len(points)),
                "engine/busy_s": sum(st.busy_s for st in stats),
                "engine/generated_tokens_total": sum(st.num_generated_tokens for st in stats),
                "engine/prefill_tokens_total": sum(st.num_prefill_tokens for st in stats),
                "engine/reused_kv_tokens_total": sum(st.num_reused_tokens for st in stats),
                "engine/version_min": min(st.version for st in stats)}

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        ray.util.remove_placement_group(self.placement_group)


def check_resources(layout: Layout) -> None:
    """Fail at once, naming what was asked and what is there, when the cluster has none of a resource the
    placement needs (an SGLang engine on a cluster without GPUs), instead of waiting for a placement that
    cannot happen. A resource that is only short may still come (an autoscaler adds nodes)."""
    asked: dict[str, float] = {}
    for bundle in layout.bundles:
        for k, v in bundle.items():
            asked[k] = asked.get(k, 0.0) + v
    present = ray.cluster_resources()
    missing = sorted(k for k, v in asked.items() if v > 0 and present.get(k, 0) == 0)
    if missing:
        raise RuntimeError(f"the placement asks for {asked} ({len(layout.bundles)} bundles: {layout.bundles}) but "
                           f"the cluster has no {', '.join(missing)}: it has "
                           f"{ {k: v for k, v in present.items() if not k.startswith('node:')} }. Use a cluster "
                           "with GPUs, or engine.server=cpu with placement.engine_gpus=0 (our CPU server)")
