"""Placement math: the bundles of the one placement group that lays out a job, or of its learner ranks with a
group of its own per engine (an elastic fleet, engine.min_engines) (no Ray calls here)."""
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
    elastic: bool = False
    """Each engine's bundle is a placement group of its own (engine.min_engines), placed on any node with
    room, again after its node left; the learner's bundles are the job's group (`learner_part`)."""
    min_engines: int = 0
    """An elastic fleet runs with at least this many engines placed."""

    def learner_part(self) -> "Layout":
        """The learner ranks' bundles alone (an elastic fleet's job group), in rank order."""
        return Layout([self.bundles[b] for b in self.learner_bundles], self.strategy, [],
                      list(range(len(self.learner_bundles))), 1.0)

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
    return bundle | {k: float(v) for k, v in cfg.placement.engine_resources.items()}


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
    return Layout(bundles, cfg.placement.strategy, list(range(n)), list(range(n, n + r)), 1.0,
                  elastic=cfg.engine.elastic, min_engines=cfg.engine.min_engines or n)


def total(resources: list[dict[str, float]]) -> dict[str, float]:
    """The sum of each resource over `resources` (bundles, or nodes)."""
    out: dict[str, float] = {}
    for r in resources:
        for k, v in r.items():
            out[k] = out.get(k, 0.0) + v
    return out


def holds(node: dict[str, float], bundle: dict[str, float]) -> bool:
    """Whether a node of these resources can take `bundle`."""
    return all(node.get(k, 0.0) >= v for k, v in bundle.items() if v > 0)


def never_fits(bundles: list[dict[str, float]], strategy: str, nodes: list[dict[str, float]]) -> str | None:
    """Why nodes of these total resources could never hold `bundles` under `strategy`, even with nothing else
    running (None: they might). Only the sure cases, so that no job Ray could place is turned away: a
    resource no node has, a bundle larger than every node, more asked than the nodes have in all,
    STRICT_PACK's sum larger than every node, STRICT_SPREAD's bundles more than the nodes that take one each."""
    asked, present = total(bundles), total(nodes)
    absent = sorted(k for k, v in asked.items() if v > 0 and present.get(k, 0) == 0)
    if absent:
        return f"the cluster has no {', '.join(absent)}"
    if strategy == "STRICT_PACK" and not any(holds(n, asked) for n in nodes):
        return f"STRICT_PACK puts all of {asked} on one node, and no node has that much"
    big = next((b for b in bundles if not any(holds(n, b) for n in nodes)), None)
    if big is not None:
        return f"no node has the {big} of one bundle"
    over = {k: v for k, v in asked.items() if v > present.get(k, 0)}
    if over:
        return f"they ask for {over} in all and the cluster has {({k: present[k] for k in over})}"
    if strategy == "STRICT_SPREAD" and spread(bundles, nodes) < len(bundles):
        return (f"STRICT_SPREAD puts each of the {len(bundles)} bundles on a node of its own, and at most "
                f"{spread(bundles, nodes)} nodes can take one each")
    return None


def spread(bundles: list[dict[str, float]], nodes: list[dict[str, float]]) -> int:
    """How many of `bundles` can each have a node of its own (a maximum bipartite matching, by augmenting paths)."""
    owner: dict[int, int] = {}  # node -> bundle

    def assign(b: int, seen: set[int]) -> bool:
        for n, node in enumerate(nodes):
            if n not in seen and holds(node, bundles[b]):
                seen.add(n)
                if n not in owner or assign(owner[n], seen):
                    owner[n] = b
                    return True
        return False

    return sum(assign(b, set()) for b in range(len(bundles)))
