"""One APRIL rollout step: the logic of the CompletionMonitor actor.

    fill N' groups (store's partial groups oldest first, then fresh prompts) -> dispatch samples to the
    least-loaded engine under its cap -> watch results in completion order, counting complete groups and
    topping the in-flight set back up to N' -> at the N-th complete group, abort every engine -> every
    outstanding call resolves (finished, or partial) -> N groups form the batch, surplus complete groups
    and partial groups go to the store.

The synchronous baseline is the same loop with N' = N, no top-up and no abort (`partial_rollout=false`).

The monitor reads only each call's small `SampleMeta`; samples stay behind handles (object refs on Ray)
that go straight to the store or, in the batch, to the learner. A group in this step is a `_Flight`: for
each sample, the latest handle (or the value it started the step with) and its state. An engine that
dies takes only the tokens of its in-flight calls with it: those samples are re-dispatched from the state
they were sent in.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Protocol

from april_ray.config import RolloutConfig
from april_ray.engine_worker import sample_meta
from april_ray.types import Group, SampleMeta, SampleState


class EngineFailure(RuntimeError):
    """An engine died; its in-flight samples are re-dispatched elsewhere."""


class EnginePool(Protocol):
    capacities: list[int]

    def generate(self, engine: int, samples: list[Any], step) -> tuple[Awaitable[list[SampleMeta]], list[Any]]:
        """Start one call for some samples of a group; returns (future of their metas, a handle per sample)."""

    async def abort_all(self, step, engines: list[int]) -> None:
        """Close the step token on these engines and abort what they run (idempotent)."""


@dataclass
class _Flight:
    group: Group
    handles: list[Any]
    """Per sample: the handle of its latest result, or the value it entered the step with."""
    states: list[SampleState]
    metas: list[SampleMeta | None]
    engine: int = -1
    """Engine of its latest call (where its samples' KV caches are parked after an abort)."""

    @classmethod
    def of(cls, group: Group) -> "_Flight":
        return cls(group, list(group.samples), [s.state for s in group.samples], [None] * len(group.samples),
                   group.engine)

    @property
    def complete(self) -> bool:
        return all(s == SampleState.FINISHED for s in self.states)

    def as_group(self) -> Group:
        """The group with handles in place of samples (the store or the learner resolves them)."""
        return Group(self.group.group_id, self.group.prompt_index, self.handles, self.group.created_step, self.engine)


@dataclass
class StepResult:
    step: int
    groups: list[list[Any]]
    """N groups, each a list of sample handles (object refs on Ray)."""
    metas: list[list[SampleMeta]]
    metrics: dict[str, float]
    staleness: dict[int, int]
    """Response tokens in the batch by age in versions (0 = on-policy)."""
    returned_group_ids: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)
    """Group id -> reason, for complete groups the dynamic filter dropped this step."""
    dropped_groups: list[list[Any]] = field(default_factory=list)
    """Their sample handles, in `dropped` order: filtered groups are kept for the consumer, not discarded."""


def filter_reason(metas: list[SampleMeta]) -> str | None:
    """DAPO dynamic sampling: a group whose rewards all agree carries no advantage signal."""
    rewards = {m.reward for m in metas}
    return "zero_reward_variance" if len(rewards) == 1 else None


class Rollout:
    def __init__(self, cfg: RolloutConfig, pool: EnginePool, source, store, clock=time.perf_counter):
        """`source` and `store` are async proxies: each method call returns an awaitable."""
        self.cfg = cfg
        self.pool = pool
        self.source = source
        self.store = store
        self.clock = clock
        self.alive = [True] * len(pool.capacities)
        self.run_id = uuid.uuid4().hex[:8]
        """Step tokens sent to engines are (run_id, step): unique even when another monitor reuses them."""
        self.num_returned_groups = 0
        self.num_dropped_groups = 0
        self.finished_handles: dict[str, Any] = {}
        """Sample id -> this monitor's handle of its finished result, for samples whose group went to
        the store unfinished: when the group comes back, the batch reuses the handle instead of making
        a new object of the store's copy (on Ray, a `ray.put` per sample was a tenth of a step)."""

    # -- one step ---------------------------------------------------------------------------------------
    async def step(self, step: int, version: int) -> StepResult:
        t0 = self.clock()
        self._begin(step, version)
        for group in await self.store.take_complete():  # surplus of the previous step comes first
            self._register(group, dispatch=False)
            self._group_done(group.group_id)
        await self._top_up()
        self._dispatch()
        self.t_dispatched = self.clock() - t0
        while self.pending and len(self.completed) < self.cfg.rollout_batch_size:
            done, _ = await asyncio.wait(self.pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                self._on_result(fut)
            if self.call_errors:
                await self._fail(f"step {step}: an engine call failed: {self.call_errors[0]}")
            await self._top_up()
            self._dispatch()
        if len(self.completed) < self.cfg.rollout_batch_size:
            await self._fail(f"step {step}: no engine left alive to finish the rollout")
        resends, abort_latency = 0, 0.0
        if self.pending:  # N-th group complete: interrupt the rest
            t_nth = self.clock()
            resends = await self._interrupt()
            abort_latency = self.clock() - t_nth
            if self.call_errors:
                await self._fail(f"step {step}: an engine call failed: {self.call_errors[0]}")
        return await self._finish(t0, abort_latency, resends)

    def _begin(self, step: int, version: int) -> None:
        self.step_id, self.version = step, version
        self.token = (self.run_id, step)
        self.flights: dict[str, _Flight] = {}
        self.queue: deque[str] = deque()
        """Groups with unfinished samples waiting to be dispatched."""
        self.pending: dict[asyncio.Future, tuple[str, list[int], int, list[Any]]] = {}
        self.load = [0] * len(self.pool.capacities)
        self.completed: list[str] = []
        self.dropped: dict[str, str] = {}
        self.generated_tokens = 0
        self.num_fresh = self.num_resumed = 0
        self.store_empty = False
        self.call_errors: list[str] = []

    def _in_flight_target(self) -> int:
        n, incomplete = self.cfg.rollout_batch_size, self._num_incomplete()
        if len(self.completed) >= n:
            return 0
        if self.cfg.partial_rollout:
            return self.cfg.over_sampling_batch_size - incomplete
        return n - len(self.completed) - incomplete  # sync: only refill what the filter dropped

    def _num_incomplete(self) -> int:
        return len(self.flights) - len(self.completed) - len(self.dropped)  # complete groups pass _group_done

    async def _top_up(self) -> None:
        need = self._in_flight_target()
        if need <= 0:
            return
        if len(self.dropped) > self.cfg.max_filtered_groups:
            await self._fail(
                f"step {self.step_id}: the dynamic filter dropped {len(self.dropped)} groups (all rewards equal) "
                f"and only {len(self.completed)} of {self.cfg.rollout_batch_size} were kept; the task is too easy "
                f"or too hard for the policy (raise rollout.max_filtered_groups or disable rollout.dynamic_filter)")
        # Only this monitor writes to the store, and only at the end of a step: once it has come back
        # short, it stays empty for the rest of the step, and each top-up is one call (to the source).
        groups = [] if self.store_empty else await self.store.take_partial(need, self.version)
        self.store_empty = len(groups) < need
        self.num_resumed += len(groups)
        fresh = await self.source.take(need - len(groups), self.step_id) if need > len(groups) else []
        self.num_fresh += len(fresh)
        for g in groups + fresh:
            self._register(g, dispatch=True)

    def _register(self, group: Group, dispatch: bool) -> None:
        assert group.group_id not in self.flights, f"group {group.group_id} is in flight twice"
        flight = self.flights[group.group_id] = _Flight.of(group)
        for i, s in enumerate(group.samples):
            if s.state == SampleState.FINISHED:
                flight.metas[i] = sample_meta(s, 0)
                flight.handles[i] = self.finished_handles.get(s.sample_id, s)
        if dispatch and not flight.complete:
            self.queue.append(group.group_id)

    def _dispatch(self) -> None:
        """Send each queued group's unfinished samples, in one call, to the least-loaded live engine, or
        back to the engine it last ran on while that one has room (its KV caches may be parked there).

        One call per group, not per sample: a group is the unit of completion, and Ray's per-call cost
        would otherwise rival a tiny model's decode step. The engine's own scheduler enforces its
        concurrency cap (excess requests wait in its queue, as on an SGLang server).
        """
        live = [e for e, ok in enumerate(self.alive) if ok]
        while self.queue and live:
            gid = self.queue.popleft()
            flight = self.flights[gid]
            idx = [i for i, st in enumerate(flight.states) if st != SampleState.FINISHED]
            engine = flight.engine
            if engine < 0 or not self.alive[engine] or self.load[engine] + len(idx) > self.pool.capacities[engine]:
                engine = min(live, key=lambda e: self.load[e] / self.pool.capacities[e])
            flight.engine = engine
            fut, handles = self.pool.generate(engine, [flight.handles[i] for i in idx], self.token)
            self.pending[asyncio.ensure_future(fut)] = (gid, idx, engine, handles)
            for i in idx:
                flight.states[i] = SampleState.RUNNING
            self.load[engine] += len(idx)

    def _on_result(self, fut: asyncio.Future) -> None:
        gid, idx, engine, handles = self.pending.pop(fut)
        self.load[engine] -= len(idx)
        flight = self.flights[gid]
        try:
            metas = fut.result()
        except Exception as e:  # the samples keep the state and handles they were sent with
            for i in idx:
                flight.states[i] = flight.metas[i].state if flight.metas[i] else flight.group.samples[i].state
            if isinstance(e, EngineFailure):  # resend them to a live engine
                self.alive[engine] = False
                self.queue.appendleft(gid)
            else:  # a bug or a bad sample: not resent; the step stores everything, then fails
                self.call_errors.append(f"group {gid} on engine {engine}: {e!r}")
            return
        for i, handle, meta in zip(idx, handles, metas):
            flight.handles[i], flight.metas[i], flight.states[i] = handle, meta, meta.state
            self.generated_tokens += meta.num_new_tokens
        if flight.complete:
            self._group_done(gid)
        elif not self._closed:
            self.queue.append(gid)  # aborted by someone else before our interrupt: resume it

    @property
    def _closed(self) -> bool:
        return len(self.completed) >= self.cfg.rollout_batch_size

    def _group_done(self, gid: str) -> None:
        reason = filter_reason(self.flights[gid].metas) if self.cfg.dynamic_filter else None
        if reason is not None:
            self.dropped[gid] = reason
        else:
            self.completed.append(gid)

    async def _interrupt(self) -> int:
        """Abort every engine and wait until every outstanding call has resolved; returns re-sends."""
        self.queue.clear()  # undispatched samples stay as they are, in their groups
        engines = [e for e, ok in enumerate(self.alive) if ok]
        await self.pool.abort_all(self.token, engines)
        resends = 0
        while self.pending:
            done, _ = await asyncio.wait(self.pending, timeout=self.cfg.abort_resend_s)
            if not done:
                resends += 1
                await self.pool.abort_all(self.token, [e for e, ok in enumerate(self.alive) if ok])
            for fut in done:
                self._on_result(fut)
            self.queue.clear()
        return resends

    # -- the doors out of a step ------------------------------------------------------------------------
    async def _finish(self, t0: float, abort_latency: float, resends: int) -> StepResult:
        n = self.cfg.rollout_batch_size
        batch, surplus = self.completed[:n], self.completed[n:]
        t_store = self.clock()
        partial = await self._stash(surplus)
        self.num_returned_groups += len(batch)
        self.num_dropped_groups += len(self.dropped)
        metas = [list(self.flights[g].metas) for g in batch]
        staleness = self._staleness(metas)
        wall = self.clock() - t0
        t_stored = self.clock() - t_store
        trained = sum(m.response_len for ms in metas for m in ms)
        off_policy = sum(c for age, c in staleness.items() if age > 0)
        metrics = {
            "rollout/wall_s": wall,
            "rollout/abort_latency_s": abort_latency,
            "rollout/abort_resends": resends,
            "rollout/start_s": self.t_dispatched,
            "rollout/store_s": t_stored,
            "rollout/generated_tokens": self.generated_tokens,
            "rollout/trained_tokens": trained,
            "rollout/effective_tok_s": trained / wall,
            "rollout/generated_tok_s": self.generated_tokens / wall,
            "rollout/off_policy_token_ratio": off_policy / max(1, trained),
            "rollout/staleness_max": max((a for a, c in staleness.items() if c), default=0),
            "rollout/staleness_mean": sum(a * c for a, c in staleness.items()) / max(1, trained),
            "rollout/groups_fresh": self.num_fresh,
            "rollout/groups_resumed": self.num_resumed,
            "rollout/groups_surplus": len(surplus),
            "rollout/groups_partial": len(partial),
            "rollout/groups_filtered": len(self.dropped),
            "rollout/reward_mean": sum(m.reward for ms in metas for m in ms) / max(1, sum(map(len, metas))),
            "rollout/response_len_mean": trained / max(1, sum(map(len, metas))),
        }
        for gid in (*batch, *self.dropped):
            for m in self.flights[gid].metas:
                self.finished_handles.pop(m.sample_id, None)
        return StepResult(self.step_id, [list(self.flights[g].handles) for g in batch], metas, metrics,
                          staleness, batch, dict(self.dropped),
                          [list(self.flights[g].handles) for g in self.dropped])

    async def _fail(self, message: str) -> None:
        """Stop the step without losing a sample: abort and drain, store everything, then raise."""
        if self.pending:
            await self._interrupt()
        await self._stash(self.completed)
        self.num_dropped_groups += len(self.dropped)
        raise RuntimeError(message)

    async def _stash(self, complete: list[str]) -> list[str]:
        """Store complete groups not returned, and every unfinished group; returns the unfinished ids."""
        partial = [gid for gid, f in self.flights.items()
                   if gid not in self.dropped and gid not in self.completed]
        if complete:
            await self.store.put_complete([self.flights[g].as_group() for g in complete])
        if partial:
            await self.store.put_partial([self.flights[g].as_group() for g in partial])
        for f in (self.flights[g] for g in (*complete, *partial)):
            for m, h in zip(f.metas, f.handles):
                if m is not None and m.state == SampleState.FINISHED:
                    self.finished_handles[m.sample_id] = h
        return partial

    def _staleness(self, metas: list[list[SampleMeta]]) -> dict[int, int]:
        hist: dict[int, int] = {}
        for ms in metas:
            for m in ms:
                for v, c in m.version_counts.items():
                    hist[self.version - v] = hist.get(self.version - v, 0) + c
        return dict(sorted(hist.items()))
