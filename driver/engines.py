"""The engines of a job: the placement group (owned here), one `EngineWorkerActor` per engine bundle,
weight publishing and engine statistics.

Engines are started once and outlive a rollout configuration, so benchmarks can compare modes on the
very same engines and data.

An engine whose process dies is restarted by Ray (`max_restarts`) in its own placement-group bundle,
under the same actor handle, so the monitor, the evaluator and the driver keep addressing it as before.
The restarted process holds its initial weights and refuses work (actors/engine_worker.py) until
`catch_up` gives it the latest published weights; the rollout step does that while it runs and hands it
back to the monitor (driver/rollout.py). Every other call here skips or retries an engine that is down instead of failing.

An elastic fleet (engine.min_engines) places each engine in a placement group of its own: when its node
leaves, Ray places the group again on a node with room and restarts the engine there; with no room now, the
engine is started again in a new group (`renew`), placed when a node joins. The rollout catches either up as
after a crash. Engines on a node Ray reports draining are told to leave gracefully (`drain`).
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import NamedTuple

import ray
from ray.exceptions import OutOfMemoryError, RayActorError
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from actors.engine_worker import EngineWorkerActor
from actors.journal import ToolJournalActor
from april_ray.config import Config
from april_ray.placement import Layout, actor_resources
from april_ray.engine.base import EngineFailure
from april_ray.types import Delivery
from driver.placement import place, place_each

log = logging.getLogger(__name__)


class ServerAccess(NamedTuple):
    """What a learner needs of an engine's server to send it weights, and the engine process's incarnation
    (a restarted engine refuses a version its old server received)."""
    url: str
    admin_key: str
    incarnation: str

    @property
    def server(self) -> tuple[str, str]:
        return self.url, self.admin_key


DOWN = (RayActorError, OutOfMemoryError, EngineFailure)
"""What a call to an engine raises while it is dead (or killed by Ray's OOM killer), restarting, or
restarted without the current weights."""


@dataclass
class EngineGroup:
    actors: list
    capacities: list[int]
    placement_group: object
    layout: Layout
    """The placement plan; learner ranks go into its learner bundles."""
    weights: tuple = (None, 0)
    """(object ref, version) of the latest published weights: what a restarted engine is brought to. Holding
    the ref keeps one copy of the weights in the object store until the next publish replaces it."""
    incarnations: list = field(default_factory=list)
    """Each engine process's incarnation id as last seen (`status`); a new one is a restart."""
    restarts: int = 0
    stats_skipped: int = 0
    """Engine statistics calls that found the engine down (that engine's stats are missing for the step)."""
    weights_source: object = None
    """A callable that puts the current weights in the object store (`take_weights_from`): how a
    restarted engine is caught up when the weights reached the servers by another channel
    (engine.weight_sync broadcast, tensor or disk), for that engine alone."""
    servers_take_weights: bool = False
    """The weights go to the engines' servers directly (engine.weight_sync broadcast, tensor or disk)."""
    releases_memory: bool = False
    """Colocated servers give their GPU memory back while the learner trains (engine.weight_sync=tensor)."""
    released: bool = False
    journal: object = None
    """The episodes' or agents' `ToolJournalActor` (None without rollout.episode_fn or rollout.agent_fn)."""
    loading: list = field(default_factory=list)
    """The engines' first `status` calls while they load (`start(wait=False)`), until `wait_loaded`."""
    engine_groups: list = field(default_factory=list)
    """An elastic fleet: each engine's placement group (the learner's is `placement_group`)."""
    min_engines: int | None = None
    """An elastic fleet: engine.min_engines, below which a step waits for engines to come back."""
    missing: set = field(default_factory=set)
    """An elastic fleet: engines not placed, or not caught up, when last looked at."""
    nodes: dict = field(default_factory=dict)
    """Engine -> the node it last answered from (`on_draining_nodes` looks for draining ones)."""
    new_engine: object = None
    """`new_engine(e, scheduling_strategy)` starts engine `e`'s actor (an elastic fleet's `renew`)."""

    @classmethod
    def start(cls, cfg: Config, model_path: str, layout: Layout, version: int = 0, timeout_s: float = 300,
              wait: bool = True) -> "EngineGroup":
        """The engine actors, placed; loaded and serving when this returns, unless `wait=False`: then they
        load meanwhile (the driver starts the learner ranks alongside) and `wait_loaded()` waits for them."""
        n, engine_groups, placed = len(layout.engine_bundles), [], range(len(layout.engine_bundles))
        if layout.elastic:
            pg = place(layout.learner_part(), timeout_s)
            engine_groups, placed = place_each(layout, timeout_s)
            where = [PlacementGroupSchedulingStrategy(g, placement_group_bundle_index=0) for g in engine_groups]
        else:
            pg = place(layout, timeout_s)
            where = [PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=b) for b in layout.engine_bundles]
        journal = start_journal(cfg)

        def new_engine(index: int, where):
            return EngineWorkerActor.options(
                **actor_resources(layout, layout.engine_bundles[index]), scheduling_strategy=where,
                max_restarts=-1,  # a dead engine comes back in its bundle, under the same handle
            ).remote(cfg.engine, cfg.sampling, cfg.staleness, cfg.task, str(model_path), version, index,
                     episodes=cfg.rollout, journal=journal, weights_root=disk_weights_dir(cfg))

        actors = [new_engine(index, w) for index, w in enumerate(where)]
        group = cls(actors, [cfg.engine.max_num_seqs] * n, pg, layout.learner_part() if layout.elastic else layout,
                    (None, version), journal=journal, servers_take_weights=cfg.engine.weight_sync != "object_store",
                    releases_memory=cfg.engine.releases_memory, loading=[e.status.remote() for e in actors],
                    engine_groups=engine_groups, min_engines=layout.min_engines if layout.elastic else None,
                    missing=set(range(n)) - set(placed), incarnations=[None] * n, new_engine=new_engine)
        if wait:
            group.wait_loaded()
        return group

    def wait_loaded(self) -> None:
        """Every engine placed has loaded the model and serves (an engine that failed to load raises here);
        an elastic fleet's others are taken in once placed (driver/rollout.py)."""
        if self.loading:
            placed = [e for e in range(len(self.actors)) if e not in self.missing]
            for e, st in zip(placed, ray.get([self.loading[e] for e in placed])):
                self.incarnations[e], self.nodes[e] = st["incarnation"], st["node"]
            self.loading = []

    def take_weights_from(self, source) -> None:
        """`source()` puts the current weights in the object store (`LearnerGroup.weights_ref`)."""
        self.weights_source = source

    def publish(self, weights_ref, version: int) -> None:
        """Every engine adopts the weights behind one object ref (one `ray.put`, no per-engine copies);
        `None`: the weights reached the servers by another channel, only the version is new.

        An engine that is down misses them; it refuses work until `catch_up` brings it to this version. One
        that died and is already back takes them here, and its restart is counted here."""
        self.weights = (weights_ref, version)
        present = self.present()
        calls = [self.actors[e].update_weights.remote(weights_ref, version) for e in present]
        for e, out in zip(present, settle(calls, self.wait_s)):
            if isinstance(out, Exception):
                log.warning("engine %d missed the weights of version %d (%s): caught up once it is back",
                            e, version, type(out).__name__)
            else:
                self.saw(e, out["incarnation"])

    def make_room_for_learner(self) -> None:
        """Colocated servers give back their weights', KV cache's and CUDA graphs' memory while the learner
        trains; an engine that is down is skipped."""
        if self.releases_memory:
            self.call_all("release_memory", ["weights", "kv_cache", "cuda_graph"])
            self.released = True

    def open_for_weights(self) -> list[ServerAccess | None]:
        """Before a publish: each engine's server (None where it is down, and everywhere when the weights
        go through the object store), with room for the weights again where it gave its memory back."""
        if not self.servers_take_weights:
            return [None] * len(self.actors)
        if self.released:
            self.call_all("resume_memory", ["weights"])
        present = self.present()
        got = dict(zip(present, settle([self.actors[e].server_access.remote() for e in present], timeout_s=60.0)))
        return [ServerAccess(*got[e]) if e in got and not isinstance(got[e], Exception) else None
                for e in range(len(self.actors))]

    def adopt(self, access: list[ServerAccess | None], deliveries: list[Delivery], version: int,
              wait_s: float = 5.0) -> None:
        """Every engine serves what the learner ranks delivered as `version`: the object-store handle, or
        the weights its server loaded (unless it was restarted since: the incarnation is checked). The
        others are caught up from the object store now if they answer, else by the rollout once back."""
        ref = next((d.weights for d in deliveries if d.weights is not None), None)
        if ref is not None:
            return self.publish(ref, version)
        if self.released:
            self.call_all("resume_memory", ["kv_cache", "cuda_graph"])
            self.released = False
        self.weights = (None, version)
        received = {url for d in deliveries for url in d.loaded}
        got = [e for e, a in enumerate(access) if a is not None and a.url in received]
        done = settle([self.actors[e].update_weights.remote(None, version, access[e].incarnation) for e in got])
        adopted = {e for e, out in zip(got, done) if not isinstance(out, Exception)}
        for e, out in zip(got, done):
            if e in adopted:
                self.saw(e, out["incarnation"])  # a restart that no step saw is counted here
        missed = [e for e in range(len(access)) if e not in adopted]
        if missed:
            log.warning("engines %s missed the weights of version %d: caught up once they answer", missed, version)
            self.catch_up(missed, wait_s)

    def call_all(self, method: str, *args) -> None:
        """One call to every engine; one that is down is skipped (it is caught up once back)."""
        settle([getattr(self.actors[e], method).remote(*args) for e in self.present()], timeout_s=60.0)

    def present(self) -> list[int]:
        """The engines not known to be missing; an elastic fleet's also alive in Ray's view (a call to an
        engine waiting for a node with room would wait with it)."""
        down = self.down() if self.min_engines is not None else set()
        return [e for e in range(len(self.actors)) if e not in self.missing and e not in down]

    def down(self) -> set[int]:
        """The engines Ray does not hold alive now: restarting, or waiting for a node with room after theirs
        left. Ray keeps a call to such an engine until it is placed again, which may be never."""
        from ray._private import state

        return {e for e, a in enumerate(self.actors)
                if state.state.actor_table(a._actor_id.hex()).get("State") != "ALIVE"}

    @property
    def wait_s(self) -> float | None:
        """How long a weight update may wait for an engine: an elastic fleet's may be waiting to be placed
        (it is caught up once back); a fixed fleet's are all placed."""
        return None if self.min_engines is None else 120.0

    def saw(self, e: int, incarnation: str) -> None:
        """Engine `e` answered from process `incarnation` (here or through a weight channel): a new one is a
        restart."""
        if incarnation != self.incarnations[e]:
            self.restarts += self.incarnations[e] is not None  # None: placed late (elastic), not restarted
            self.incarnations[e] = incarnation

    def catch_up(self, engines: list[int], wait_s: float) -> list[int]:
        """Of `engines`, those that answer within `wait_s` and now serve the latest weights (restarted ones
        get them first); counts restarts. The others are still down (an elastic fleet's engines that Ray has
        not placed again are not asked: a call would wait for them)."""
        if self.min_engines is not None:
            down = self.down()
            engines = [e for e in engines if e not in down]
        ref, version = self.weights
        status = settle([self.actors[e].status.remote() for e in engines], wait_s)
        behind = []
        for e, st in zip(engines, status):
            if isinstance(st, Exception):
                continue
            self.saw(e, st["incarnation"])
            self.nodes[e] = st["node"]
            if not st["serving"] or st["version"] != version:
                behind.append(e)
        if behind and ref is None and version > 0:
            ref = self._weights_in_object_store(version)
        done = settle([self.actors[e].update_weights.remote(ref, version) for e in behind], wait_s)
        failed = {e for e, out in zip(behind, done) if isinstance(out, Exception)}
        for e, out in zip(behind, done):
            if e not in failed:
                self.saw(e, out["incarnation"])  # died again between its status and its update
        return [e for e, st in zip(engines, status) if not isinstance(st, Exception) and e not in failed]

    def _weights_in_object_store(self, version: int):
        """The weights of `version` went to the servers by another channel: put them in the object store
        once (kept for further restarts until the next publish) for the restarted engines alone."""
        if self.weights_source is None:
            raise RuntimeError(f"an engine was restarted, and the weights of version {version} reached the "
                               "engines by another channel than the object store, with no source to catch it up from")
        self.weights = (self.weights_source(), version)
        return self.weights[0]

    def serving(self, wait_s: float = 300.0) -> list[int]:
        """Every engine that serves the latest weights, waiting up to `wait_s` for at least one."""
        deadline = time.monotonic() + wait_s
        while True:
            up = self.catch_up(list(range(len(self.actors))), wait_s=2.0)
            if up or time.monotonic() > deadline:
                return up
            time.sleep(1.0)

    def on_draining_nodes(self) -> list[int]:
        """The engines whose node Ray reports draining (`ray drain-node`, an autoscaler's preemption or
        scale-down notice)."""
        from ray._private import state

        draining = state.state.get_draining_nodes()
        return sorted(e for e, node in self.nodes.items() if node in draining)

    def renew(self, down: set[int]) -> list[int]:
        """An elastic fleet: each engine of `down` whose node was lost and that Ray could not place again is
        started again, under a new handle, in a new placement group that Ray places whenever a node has room.
        Ray would place the old group itself, but it retries a group whose node died with no backoff: with no
        room anywhere the GCS spent half a core on it and steps took 60-90 s instead of 3 (BENCHMARKS.md,
        "Engines that come and go"). A new group is retried at most once a second. Returns the engines started
        again."""
        lost = [e for e in sorted(down) if placement_group_table(self.engine_groups[e])["state"] == "RESCHEDULING"]
        for e in lost:
            old = self.engine_groups[e]
            ray.kill(self.actors[e], no_restart=True)
            remove_placement_group(old)
            self.engine_groups[e] = placement_group(old.bundle_specs, strategy="PACK")
            self.actors[e] = self.new_engine(e, PlacementGroupSchedulingStrategy(self.engine_groups[e], 0))
        if lost:
            log.warning("engines %s lost their node and wait for room in new placement groups", lost)
        return lost

    def drain(self, engines: list[int], timeout_s: float = 60.0) -> None:
        """These engines leave gracefully: each returns once its running calls handed back their partial
        samples with every token (one that is down already is skipped)."""
        settle([self.actors[e].drain.remote() for e in engines], timeout_s)

    def urls(self) -> list[str]:
        """A server backend: each engine's server, in engine order."""
        return ray.get([e.server_url.remote() for e in self.actors])

    def stats(self, drain: bool = True) -> list:
        """Each engine's statistics; None for an engine that is down (counted in `stats_skipped`) or missing
        (an elastic fleet's: not asked, it would not answer)."""
        asked = self.present()
        got = dict(zip(asked, settle([self.actors[e].stats.remote(drain) for e in asked], timeout_s=10.0)))
        self.stats_skipped += sum(isinstance(st, Exception) for st in got.values())
        return [None if isinstance(got.get(e), Exception) else got.get(e) for e in range(len(self.actors))]

    def occupancy_metrics(self, stats: list) -> dict[str, float]:
        """From the engines' `stats()`: running-batch occupancy since they were last drained (mean over decode
        steps, as a fraction of the cap), their counters, and the tool calls of their episodes."""
        stats, caps = [st for st in stats if st is not None], [c for st, c in zip(stats, self.capacities) if st]
        if not stats:
            return {"engine/stats_skipped": self.stats_skipped, "engine/restarts": self.restarts}
        points = [n / cap for st, cap in zip(stats, caps) for _, n in st.occupancy]
        return {"engine/occupancy_mean": sum(points) / max(1, len(points)),
                "engine/busy_s": sum(st.busy_s for st in stats),
                "engine/generated_tokens_total": sum(st.num_generated_tokens for st in stats),
                "engine/prefill_tokens_total": sum(st.num_prefill_tokens for st in stats),
                "engine/reused_kv_tokens_total": sum(st.num_reused_tokens for st in stats),
                "engine/version_min": min(st.version for st in stats),
                "rollout/reward_errors": sum(st.reward_errors for st in stats),
                "rollout/tool_calls": sum(st.tool_calls for st in stats),
                "rollout/tool_errors": sum(st.tool_errors for st in stats),
                "rollout/tool_replays": sum(st.tool_replays for st in stats),
                **{f"rollout/agent_{k}": sum(getattr(st, f"agent_{k}") for st in stats)
                   for k in ("requests", "resumed", "mismatch", "errors")},
                "rollout/tool_s_mean": sum(st.tool_s for st in stats) / max(1, sum(st.tool_calls for st in stats)),
                "engine/stats_skipped": self.stats_skipped, "engine/restarts": self.restarts}

    def shutdown(self) -> None:
        for actor in self.actors + ([self.journal] if self.journal is not None else []):
            ray.kill(actor)
        for pg in [self.placement_group, *self.engine_groups]:
            ray.util.remove_placement_group(pg)


def disk_weights_dir(cfg: Config) -> str:
    """Where engine.weight_sync=disk writes the weights every server loads (storage every node sees)."""
    return str(Path(cfg.train.output_dir).resolve() / "weights")


def start_journal(cfg: Config):
    """With episodes or agents, the job's tool journal: on the driver's node, its file in train.output_dir (a
    resumed job reads it back, so no tool call that returned runs again after a restart; an agent's calls
    reach it through its endpoint's `/v1/april/journal`)."""
    if not (cfg.rollout.episode_fn or cfg.rollout.agent_fn):
        return None
    node = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    path = Path(cfg.train.output_dir).resolve() / "tool_journal.jsonl"
    return ToolJournalActor.options(scheduling_strategy=node).remote(str(path), os.getpid())  # gone: no new call


def settle(refs: list, timeout_s: float | None = None) -> list:
    """The value of each call, or the exception of an engine that is down (`DOWN`, or a call still
    unanswered after `timeout_s`); any other error is raised."""
    if timeout_s is not None and refs:
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref, timeout=0 if timeout_s is not None else None))
        except DOWN as e:
            out.append(e)
        except ray.exceptions.GetTimeoutError as e:
            out.append(e)
    return out
