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
        pg = placement_group(layout.bundles, strategy=layout.strategy)
        if not pg.wait(timeout_s):
            raise RuntimeError(f"placement group {layout.bundles} ({layout.strategy}) could not be placed within "
                               f"{timeout_s:.0f}s; cluster resources: {ray.cluster_resources()}")
        actors = [
            EngineWorkerActor.options(
                **actor_resources(layout, b),
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b),
            ).remote(cfg.engine, cfg.sampling, cfg.staleness, cfg.task.name, str(model_path), version)
            for b in layout.engine_bundles
        ]
        ray.get([e.stats.remote() for e in actors])  # loaded and serving
        return cls(actors, [cfg.engine.max_num_seqs] * len(actors), pg, layout)

    def publish(self, weights_ref, version: int) -> None:
        """Every engine adopts the weights behind one object ref (one `ray.put`, no per-engine copies)."""
        ray.get([e.update_weights.remote(weights_ref, version) for e in self.actors])

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
