"""Placement math: the bundles of the one placement group that lays out a job (no Ray calls here)."""
from __future__ import annotations

from dataclasses import dataclass

from april_ray.config import Config


@dataclass(frozen=True)
class Layout:
    bundles: list[dict[str, float]]
    strategy: str
    engine_bundles: list[int]
    """Bundle index of each engine, in engine order."""
    learner_bundles: list[int]
    """Bundle index of each learner rank."""
    share: float
    """Fraction of its bundle that each actor asks for (0.5 when a learner and an engine share one)."""

    @property
    def colocated(self) -> bool:
        """Engines and learner ranks share bundles (and their GPUs)."""
        return bool(set(self.engine_bundles) & set(self.learner_bundles))


def actor_resources(layout: Layout, bundle: int) -> dict[str, float]:
    """num_cpus / num_gpus for an actor placed in `bundle`."""
    b = layout.bundles[bundle]
    return {"num_cpus": b.get("CPU", 0) * layout.share, "num_gpus": b.get("GPU", 0) * layout.share}


def engine_bundle(cfg: Config) -> dict[str, float]:
    bundle = {"CPU": cfg.placement.engine_cpus}
    if cfg.placement.engine_gpus:
        bundle["GPU"] = float(cfg.placement.engine_gpus)
    return bundle


def learner_bundle(cfg: Config) -> dict[str, float]:
    bundle = {"CPU": cfg.learner.cpus}
    if cfg.learner.gpus:
        bundle["GPU"] = float(cfg.learner.gpus)
    return bundle


def plan(cfg: Config) -> Layout:
    n, r = cfg.engine.num_engines, cfg.learner.num_ranks
    if cfg.placement.colocate:
        # One bundle per engine holds its GPUs; the engine and learner rank i each ask half of it, so
        # Ray places both on the same devices (CUDA_VISIBLE_DEVICES is the same for both).
        merged = {k: max(engine_bundle(cfg).get(k, 0), learner_bundle(cfg).get(k, 0))
                  for k in {*engine_bundle(cfg), *learner_bundle(cfg)}}
        return Layout([merged] * n, cfg.placement.strategy, list(range(n)), list(range(r)), 0.5)
    bundles = [engine_bundle(cfg)] * n + [learner_bundle(cfg)] * r
    return Layout(bundles, cfg.placement.strategy, list(range(n)), list(range(n, n + r)), 1.0)
