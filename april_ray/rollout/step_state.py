"""What the completion monitor keeps during one rollout step (april_ray/rollout/monitor.py).

A `StepState` is created when a step starts and dropped when it ends. It holds the step's groups as
`Flight`s, its outstanding engine calls as `Call`s, the engines' loads, and a completion queue: every
call's future puts itself there when it resolves, so the monitor wakes once per result and reads results
in completion order, at a cost that does not grow with the number of calls in flight (`asyncio.wait`
over every pending future would be a pass over all of them at each wake-up: at a thousand engines that
was most of the control plane's time).
"""
from __future__ import annotations

import asyncio
import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from april_ray.types import Group, HeldGroup, SampleMeta, SampleState


class EngineLoads:
    """Samples in flight per engine, and the least loaded live engine (by load / capacity, the lowest
    index among equals) in O(log engines): a heap of (load / capacity, engine) entries, one pushed at every
    change; an entry that no longer matches its engine's load is stale and dropped when it surfaces."""

    def __init__(self, capacities: list[int]):
        self.capacities = capacities
        self.load = [0] * len(capacities)
        self.heap = [(0.0, e) for e in range(len(capacities))]

    def __getitem__(self, engine: int) -> int:
        return self.load[engine]

    def add(self, engine: int, samples: int) -> None:
        self.load[engine] += samples
        heapq.heappush(self.heap, (self.load[engine] / self.capacities[engine], engine))
        if len(self.heap) > 8 * len(self.load) + 64:  # drop the stale entries
            self.heap = [(n / c, e) for e, (n, c) in enumerate(zip(self.load, self.capacities))]
            heapq.heapify(self.heap)

    def least(self, alive: list[bool]) -> int | None:
        """The least loaded engine among the live ones; None when none is alive."""
        heap, dead, found = self.heap, [], None
        while heap:
            ratio, e = heap[0]
            if ratio != self.load[e] / self.capacities[e]:
                heapq.heappop(heap)
            elif not alive[e]:
                dead.append(heapq.heappop(heap))
            else:
                found = e
                break
        for entry in dead:  # kept for when the engine comes back
            heapq.heappush(heap, entry)
        return found


class Completions:
    """The futures of a step's calls, in the order they resolved."""

    def __init__(self):
        self.done: deque[asyncio.Future] = deque()
        self.ready = asyncio.Event()

    def watch(self, fut: asyncio.Future) -> None:
        fut.add_done_callback(self._resolved)

    def _resolved(self, fut: asyncio.Future) -> None:
        self.done.append(fut)
        self.ready.set()

    async def wait(self, timeout: float | None = None) -> list[asyncio.Future]:
        """Every future resolved so far and not yet taken, waiting for one first (at most `timeout`
        seconds: [] when none resolved in time)."""
        if not self.done:
            self.ready.clear()
            if timeout is None:
                await self.ready.wait()
            else:
                try:
                    await asyncio.wait_for(self.ready.wait(), timeout)
                except asyncio.TimeoutError:
                    return []
        done = list(self.done)
        self.done.clear()
        return done


@dataclass
class Flight:
    """A group during one step: per sample, its latest handle (or the value it entered with), its state and,
    for a finished sample, its meta."""

    group: HeldGroup
    handles: list[Any]
    states: list[SampleState]
    metas: list[SampleMeta | None]
    engine: int = -1
    """Engine of its latest call (where its samples' KV caches are parked after an abort)."""

    @classmethod
    def of(cls, group: HeldGroup) -> "Flight":
        return cls(group, list(group.handles), [m.state for m in group.metas], [None] * len(group.metas),
                   group.engine)

    @property
    def complete(self) -> bool:
        return all(s == SampleState.FINISHED for s in self.states)

    def as_group(self) -> Group:
        """The group with handles in place of samples (the store or the learner resolves them)."""
        return Group(self.group.group_id, self.group.prompt_index, self.handles, self.group.created_step, self.engine)


@dataclass
class Call:
    """One outstanding `generate` call: some samples of one group on one engine."""

    group_id: str
    indices: list[int]
    """Which samples of the group it carries."""
    engine: int
    handles: list[Any]
    """A handle per carried sample, for its result, then one per context sample."""
    sent_s: float = 0.0
    context: list[int] = field(default_factory=list)
    """The group's finished samples sent beside them (task.reward_per_group), to be scored with them if the
    call completes the group."""


@dataclass
class StepState:
    step: int
    version: int
    token: tuple
    """Sent with every call and abort of this step: (monitor run id, step)."""
    load: EngineLoads
    """Samples in flight per engine."""
    flights: dict[str, Flight] = field(default_factory=dict)
    queue: deque = field(default_factory=deque)
    """Ids of groups with unfinished samples waiting to be dispatched."""
    pending: dict[asyncio.Future, Call] = field(default_factory=dict)
    completions: Completions = field(default_factory=Completions)
    """The pending calls' futures, as they resolve."""
    completed: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)
    call_errors: list[str] = field(default_factory=list)
    episode_errors: dict[str, str] = field(default_factory=dict)
    """Sample id -> traceback, of the episodes that raised in the groups dropped as `episode_error`."""
    num_groups_done: int = 0
    num_groups_failed: int = 0
    """Groups complete this step, and those of them in which every sample failed: its episode raised, or
    its reward call failed."""
    first_failure: str | None = None
    """The first of those errors (an episode's traceback, or a reward's error naming its key)."""
    generated_tokens: int = 0
    num_fresh: int = 0
    num_resumed: int = 0
    num_episodes_resumed: int = 0
    """Samples taken from the store with an episode interrupted mid-trajectory (they go on at their turn)."""
    store_empty: bool = False
    """Only this monitor writes to the store, and only at a step's end: once it came back short, it stays so."""
    start_s: float = 0.0
    abort_latency_s: float = 0.0
    abort_resends: int = 0
    engine_crashes: int = 0
    engine_leaves: int = 0
    """Engines that left gracefully (`EngineLeft`) this step: their samples came back with every token."""
    crash_tokens_lost: float = 0.0
    sample_seconds: float = 0.0
    """Seconds on an engine summed over the samples of every returned call (counted from the step's start
    for a call sent before it), with `generated_tokens` the step's per-sequence token rate."""
    started_s: float = 0.0
    """When the step started, on the monitor's clock."""

    @property
    def num_incomplete(self) -> int:
        return len(self.flights) - len(self.completed) - len(self.dropped)

    def leaving(self, gone: list[str], surplus: list[str]) -> "StepState":
        """This state once the `gone` groups left it (returned or dropped), with `surplus` its complete groups:
        what goes on running into the next step."""
        for gid in gone:
            del self.flights[gid]
        self.completed, self.dropped = list(surplus), {}
        return self

    def go_on(self, step: int, version: int, now: float) -> "StepState":
        """The next step's state over the groups still running: the same calls, engines' loads and step token
        (the engines know the calls by it), the counters from zero; its complete groups are re-counted."""
        return StepState(step, version, self.token, self.load, self.flights, self.queue, self.pending,
                         self.completions, started_s=now)

    def partial_ids(self) -> list[str]:
        done = set(self.completed)
        return [g for g in self.flights if g not in self.dropped and g not in done]

