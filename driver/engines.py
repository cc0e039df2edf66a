"""Starts a job's actors on Ray: one placement group, the engines, and the rollout (source, store, monitor).

Engines are started once and outlive a rollout configuration, so benchmarks can compare modes on the
very same engines and data.
"""
from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.engine_worker import EngineWorkerActor
from actors.monitor import CompletionMonitorActor
from actors.prompt_source import PromptSourceActor
from actors.store import StoreActor
from april_ray.config import Config
from april_ray.data import dataset_paths
from april_ray.placement import actor_resources, plan


@dataclass
class Engines:
    actors: list
    capacities: list[int]
    placement_group: object
    layout: object
    """The placement plan; learner ranks go into its learner bundles."""

    def publish(self, state_dict_ref, version: int) -> None:
        """Every engine adopts the weights behind one object ref (one `ray.put`, no per-engine copies)."""
        ray.get([e.update_weights.remote(state_dict_ref, version) for e in self.actors])

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


@dataclass
class RolloutActors:
    source: object
    store: object
    monitor: object

    def shutdown(self) -> None:
        for actor in (self.source, self.store, self.monitor):
            ray.kill(actor)


def start_engines(cfg: Config, model_path: str, version: int = 0, timeout_s: float = 300) -> Engines:
    layout = plan(cfg)
    pg = placement_group(layout.bundles, strategy=layout.strategy)
    if not pg.wait(timeout_s):
        raise RuntimeError(f"placement group {layout.bundles} ({layout.strategy}) could not be placed within "
                           f"{timeout_s:.0f}s; cluster resources: {ray.cluster_resources()}")
    actors = [
        EngineWorkerActor.options(
            **actor_resources(layout, b), scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b),
        ).remote(cfg.engine, cfg.rollout, cfg.task.name, str(model_path), version)
        for b in layout.engine_bundles
    ]
    ray.get([e.stats.remote() for e in actors])  # loaded and serving
    return Engines(actors, [cfg.engine.max_num_seqs] * len(actors), pg, layout)


def start_rollout(cfg: Config, model_path: str, engines: Engines) -> RolloutActors:
    train_path, _ = dataset_paths(cfg.task, cfg.model.cache_dir)
    source = PromptSourceActor.remote(str(train_path), cfg.task.prompt_key, cfg.task.answer_key, str(model_path),
                                      cfg.rollout.n_samples_per_prompt, cfg.rollout.max_response_len, cfg.task.seed)
    store = StoreActor.remote(cfg.rollout.max_staleness, cfg.rollout.stale_policy)
    monitor = CompletionMonitorActor.remote(cfg.rollout, engines.actors, engines.capacities, source, store)
    return RolloutActors(source, store, monitor)
