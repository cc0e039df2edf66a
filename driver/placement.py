"""The job's one placement group on the cluster: made, and waited for while saying what it waits for; and
an elastic fleet's placement group per engine (`place_each`).

A placement the cluster can never hold (`april_ray.placement.never_fits` on the nodes' totals) fails at once
unless an autoscaler may add nodes; one that waits for resources in use, or for an autoscaler, says so after
`FIRST_LOOK_S`, again every `REMIND_S`, and is given up after the timeout. Each message names the bundles
asked and the resources free, per node where there are several.
"""
from __future__ import annotations

import itertools
import json
import re
import time

import ray
from ray._private import state
from ray.util.placement_group import placement_group, remove_placement_group

from april_ray.placement import Layout, never_fits, total

FIRST_LOOK_S = 3.0
"""How long a placement may take before the job says what it waits for (an idle cluster places at once)."""
REMIND_S = 30.0
MIRRORED = re.compile(r"node_[0-9a-f]+")
"""The node type Ray's autoscaler gives a node it did not launch (`format_readonly_node_type`)."""
HIDDEN = ("memory", "object_store_memory")


class PlacementError(ValueError):
    """The cluster cannot hold the job's placement group: the user's to fix (jobs.train prints its one line)."""


def place(layout: Layout, timeout_s: float = 300, remind_s: float = REMIND_S):
    """The placement group of `layout`, placed; `PlacementError` when it never can be, or is not within
    `timeout_s`."""
    nodes = list(state.total_resources_per_node().values())
    never = never_fits(layout.bundles, layout.strategy, nodes)
    scaler = autoscaler() if never else None
    if never and scaler is None:
        raise PlacementError(f"{waits_for(layout)}: it can never hold them ({never}), and no autoscaler can add "
                             f"nodes. {advice(never)}")
    pg = placement_group(layout.bundles, strategy=layout.strategy)
    why = f"{scaler} may add nodes ({never})" if never else "resources in use may come free"
    if not placed(pg, layout, timeout_s, remind_s, why):
        remove_placement_group(pg)
        raise PlacementError(f"could not be placed within {timeout_s:.0f}s: {waits_for(layout)}. "
                             f"{advice(never or '')}")
    return pg


def place_each(layout: Layout, timeout_s: float = 300, remind_s: float = REMIND_S) -> tuple[list, list[int]]:
    """An elastic fleet's engines: a placement group of one bundle per engine, each placed on any node with
    room (and by Ray again, on any node with room, after its node left). Returns the groups and the engines
    placed, once at least `layout.min_engines` are; the others are placed whenever room comes (a node
    joins). `PlacementError` when an engine's bundle never fits, or too few are placed within `timeout_s`."""
    bundles = [layout.bundles[b] for b in layout.engine_bundles]
    nodes = list(state.total_resources_per_node().values())
    never = never_fits(bundles[:1], "PACK", nodes)
    if never and autoscaler() is None:
        raise PlacementError(f"an engine's bundle {bundles[0]}: the cluster can never hold it ({never}), and no "
                             f"autoscaler can add nodes. {advice(never)}")
    pgs = [placement_group([b], strategy="PACK") for b in bundles]
    refs, start, need = [pg.ready() for pg in pgs], time.monotonic(), layout.min_engines
    for k in itertools.count():
        at = min(FIRST_LOOK_S + k * remind_s, timeout_s)
        done, _ = ray.wait(refs, num_returns=need, timeout=max(0.0, start + at - time.monotonic()))
        if len(done) >= need:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            return pgs, [e for e, ref in enumerate(refs) if ref in done]
        if at >= timeout_s:
            for pg in pgs:
                remove_placement_group(pg)
            raise PlacementError(f"{len(done)} of engine.min_engines={need} engines placed within {timeout_s:.0f}s: "
                                 f"{waits_for(Layout(bundles, 'PACK', [], [], 1.0))}. {advice(never or '')}")
        print(f"{len(done)} of engine.min_engines={need} engines placed; waiting up to {timeout_s:.0f}s: "
              f"{waits_for(Layout(bundles, 'PACK', [], [], 1.0))}", flush=True)


def placed(pg, layout: Layout, timeout_s: float, remind_s: float, why: str) -> bool:
    """Whether `pg` is placed within `timeout_s`; past `FIRST_LOOK_S` it says what it waits for and `why`, and
    again every `remind_s`."""
    start, ready = time.monotonic(), pg.ready()
    for k in itertools.count():
        at = min(FIRST_LOOK_S + k * remind_s, timeout_s)
        if ray.wait([ready], timeout=max(0.0, start + at - time.monotonic()))[0]:
            if k:
                print(f"placed after {time.monotonic() - start:.0f}s", flush=True)
            return True
        if at >= timeout_s:
            return False
        print(f"{waits_for(layout)}; waiting up to {timeout_s:.0f}s: {why}" if k == 0 else
              f"still waiting after {at:.0f}s: {waits_for(layout)}", flush=True)


def waits_for(layout: Layout) -> str:
    """The bundles asked and the resources free now, per node where there are several, in one line."""
    asked = total(layout.bundles)
    free = state.available_resources_per_node()
    whole = state.total_resources_per_node()
    keys = sorted({*asked, *(k for k in total(list(whole.values())) if shown(k))})

    def of(resources: dict) -> dict:
        return {k: round(resources.get(k, 0.0), 2) for k in keys}

    text = (f"the placement group asks for {of(asked)} in {len(layout.bundles)} bundles {layout.bundles} "
            f"({layout.strategy}); the cluster has {of(total(list(free.values())))} free of "
            f"{of(total(list(whole.values())))}")
    if len(whole) > 1:
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        named = len(set(ips.values())) == len(ips)  # else several raylets on one machine: their ids
        text += " (" + "; ".join(f"node {ips[n] if named else n} {of(free.get(n, {}))} free of {of(r)}"
                                 for n, r in whole.items()) + ")"
    return text


def shown(resource: str) -> bool:
    """A resource worth naming: not a node's address, memory, or a placement group's share."""
    return not resource.startswith("node:") and resource not in HIDDEN and "_group_" not in resource


def advice(never: str) -> str:
    text = ("Ask for less (engine.num_engines, learner.num_ranks, placement.engine_cpus, placement.engine_gpus, "
            "learner.cpus, learner.gpus) or give the cluster more (ray start --num-cpus/--num-gpus, more nodes)")
    if "no GPU" in never:
        text += "; without GPUs, engine.backend=cpu_http with placement.engine_gpus=0 runs our CPU server"
    return text


def autoscaler() -> str | None:
    """What may add nodes to the cluster, in words (None: nothing can). Ray's autoscaler, started with a
    cluster config (`ray up`, `ray start --autoscaling-config`, KubeRay), names its nodes by the config's node
    types (v1 in its status, v2 from each node's RAY_NODE_TYPE_NAME, which `ray up` and KubeRay set); on a
    cluster started without one (`ray start`, `ray.init`) it only mirrors the nodes there are, each as its own
    type `node_<id>`, and launches none."""
    from ray.autoscaler.v2.utils import is_autoscaler_v2

    if is_autoscaler_v2(fetch_from_server=True):
        from ray.autoscaler.v2.sdk import get_cluster_status

        status = get_cluster_status(ray.get_runtime_context().gcs_address)
        types = {n.ray_node_type_name for n in [*status.active_nodes, *status.idle_nodes, *status.pending_nodes,
                                                *status.pending_launches]}
    else:
        from ray._private.ray_constants import DEBUG_AUTOSCALING_STATUS
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get(DEBUG_AUTOSCALING_STATUS)
        types = report_node_types(json.loads(raw)) if raw else set()
    configured = from_config(types)
    return f"Ray's autoscaler (node types {', '.join(configured)})" if configured else None


def from_config(node_types: set[str]) -> list[str]:
    """The node types a cluster config named (not those the autoscaler makes up for nodes it mirrors)."""
    return sorted(t for t in node_types if t and not MIRRORED.fullmatch(t))


def report_node_types(status: dict) -> set[str]:
    """The node types in the status Ray's autoscaler (v1) writes to the GCS every few seconds."""
    report = status.get("autoscaler_report") or {}
    return {*(report.get("active_nodes") or {}), *(report.get("idle_nodes") or {}),
            *(report.get("pending_launches") or {}), *(t for _, t, *_ in report.get("pending_nodes") or []),
            *(t for _, t in report.get("failed_nodes") or [])}
