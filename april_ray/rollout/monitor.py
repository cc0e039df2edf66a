"""The completion monitor: one APRIL rollout step (and the synchronous baseline).

    fill N' groups (store's partial groups oldest first, then fresh prompts) -> dispatch samples to the
    least-loaded engine under its cap -> watch results in completion order, counting complete groups and
    topping the in-flight set back up to N' -> at the N-th complete group, abort every engine -> every
    outstanding call resolves (finished, or partial) -> N groups form the batch, surplus complete groups
    and partial groups go to the store.

A step asked to `keep_running` (the overlapped mode, train.overlap) returns its batch at the N-th complete
group without the interrupt when the next step has already been asked for: its other groups go on
generating on the engines while the learner trains, and the next step continues them (`running`: the
same calls, loads and step token), so the engines never stop while the driver keeps asking ahead. With no
step asked after it, the rollout is as far ahead of the learner as the driver asks it to go
(train.overlap_ahead, at most staleness.max_versions), and the step interrupts and stores as usual. A
step that is not asked to (the synchronous modes, and the overlapped mode's steps before a checkpoint and
the last one) ends as above, and leaves nothing running.

The schedule (`rollout.schedule`, april_ray/schedule.py) decides how many groups to start, whether a step
may keep running, and whether the leftovers at the interrupt are stored or discarded (`oversample`: those
are counted with the filter's drops in `num_dropped_groups`, taken, neither returned nor stored, and
`StepResult.discarded` names them). A failed step stores everything, whatever the schedule.

`CompletionMonitor` holds what lives across steps (engines' liveness, counters, the handles of finished
samples whose groups wait in the store); everything about one step lives in a `StepState`, created when
the step starts and dropped when it ends. The monitor reads only each call's small `SampleMeta`; samples
stay behind handles (object refs on Ray) that go straight to the store or, in the batch, to the learner.
An engine that dies takes only the tokens of its in-flight calls with it: those samples are re-dispatched
from the state they were sent in, and the engine takes no more work until `revive` hands it back (the
driver calls it once the restarted engine holds the current weights: driver/engines.py). With every engine
dead, a step waits up to `rollout.engine_wait_s` for one to come back before it fails.
"""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from typing import Any, Awaitable, Protocol

from april_ray.config import RolloutConfig, StalenessConfig
from april_ray.engine.base import EngineFailure, EngineLeft
from april_ray.rollout.liveness import EngineLiveness
from april_ray.rollout.over_sampling import build_over_sampling
from april_ray.rollout.store import held
from april_ray.rollout.step_metrics import batch_staleness, over_sampling_metrics, step_metrics
from april_ray.rollout.step_order import StepOrder
from april_ray.rollout.step_state import Call, EngineLoads, Flight, StepState
from april_ray.schedule import build_schedule
from april_ray.types import HeldGroup, SampleMeta, SampleState, StepResult


class StepFailed(RuntimeError):
    """A step could not finish; every sample of it was stored before this was raised."""


class EnginePool(Protocol):
    capacities: list[int]
    reward_per_group: bool
    """The engines score whole groups (task.reward_per_group): each call takes the group's finished samples."""

    def generate(self, engine: int, samples: list[Any], step, context: list[Any] = ()
                 ) -> tuple[Awaitable[list[SampleMeta]], list[Any]]:
        """Start one call for some samples of a group, with the handles of its finished ones as `context`;
        returns (future of their metas, a handle per sample, then per context sample). The metas cover the
        context samples too when the call completed the group (engine_worker.EngineWorker.generate_group)."""

    async def abort_all(self, step, engines: list[int]) -> None:
        """Close the step token on these engines and abort what they run (idempotent)."""


def filter_reason(metas: list[SampleMeta]) -> str | None:
    """DAPO dynamic sampling: a group whose rewards all agree carries no advantage signal."""
    rewards = {m.reward for m in metas}
    return "zero_reward_variance" if len(rewards) == 1 else None


class CompletionMonitor:
    def __init__(self, cfg: RolloutConfig, pool: EnginePool, source, store, staleness: StalenessConfig):
        """`source` and `store` are async proxies: each method call returns an awaitable. `staleness` says
        which of a batch's tokens the learner masks (what the auto N' observes, with the engines' occupancy)."""
        self.cfg = cfg
        self.staleness = staleness
        self.schedule = build_schedule(cfg.schedule)
        self.over_sampling = build_over_sampling(cfg)
        """N': fixed, or adapted at the end of every step (april_ray/rollout/over_sampling.py)."""
        self.pool = pool
        self.source = source
        self.store = store
        self.engines = EngineLiveness(len(pool.capacities))
        self.alive, self.heard_s = self.engines.alive, self.engines.heard_s
        """The engines' liveness, and when each last returned a call (the lists `engines` keeps)."""
        self.run_id = uuid.uuid4().hex[:8]
        """Step tokens sent to engines are (run_id, step): unique even when another monitor reuses them."""
        self.num_returned_groups = 0
        self.num_dropped_groups = 0
        self.num_engine_crashes = 0
        self.leaves_between = 0  # engines that left between steps: the next step's rollout/engine_leaves
        self.token_rate = 0.0
        """Tokens per second per sequence in the last step's returned calls (the crash-loss estimate)."""
        self.finished_handles: dict[str, Any] = {}
        """Sample id -> this monitor's handle of its finished result, for samples whose group went to
        the store unfinished: when the group comes back, the batch reuses the handle instead of making
        a new object of the store's copy (on Ray, a `ray.put` per sample)."""
        self.finished_metas: dict[str, SampleMeta] = {}
        """Sample id -> its meta (as of no new tokens), for the same samples: the meta the store hands back
        beside its handle is of the same unchanged sample."""
        self.order = StepOrder()
        self.running: StepState | None = None
        """The last step's groups left running on the engines (`keep_running`): the next step goes on with them."""

    @staticmethod
    def clock() -> float:
        """Seconds on the event loop's clock (monotonic)."""
        return asyncio.get_running_loop().time()

    # -- what lives across steps -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What a checkpoint keeps of the monitor (the store and the source keep the rest): taken between
        steps that left nothing running, so every group taken is returned, dropped or in the store."""
        if self.running is not None:
            raise RuntimeError("a checkpoint needs the rollout drained: the last step left groups running "
                               "(keep_running=False on the step before a checkpoint)")
        return {"returned_groups": self.num_returned_groups, "dropped_groups": self.num_dropped_groups,
                "over_sampling": self.over_sampling.state_dict(), "reward_per_group": self.pool.reward_per_group}

    def load_state_dict(self, state: dict) -> None:
        """With the store restored beside it: what the monitor kept of the stored samples (their handles
        and metas, by sample id) is of samples no longer there, and the source may hand the ids out again.
        The stored groups were scored one way (a group's finished samples wait unscored under
        task.reward_per_group), so a resume must score them the same way."""
        ours = self.pool.reward_per_group
        if state.get("reward_per_group", False) != ours:
            raise ValueError(f"task.reward_per_group={str(ours).lower()}, but the checkpoint's store was filled "
                             f"with task.reward_per_group={str(not ours).lower()}; resume with the value it was "
                             f"saved with, or start over (train.start_over=true)")
        self.num_returned_groups = state["returned_groups"]
        self.num_dropped_groups = state["dropped_groups"]
        if state.get("over_sampling"):  # the auto N' goes on from where it was (absent before it existed)
            self.over_sampling.load_state_dict(state["over_sampling"])
        self.finished_handles.clear()
        self.finished_metas.clear()

    async def dead_engines(self, known: list[int], step: int) -> list[int]:
        """The engines now dead, as soon as that differs from `known`, or once `step` has ended: what the
        driver waits on to bring lost engines back (it learns of a death when the monitor does)."""
        return await self.engines.changes(known, lambda: self.order.last_step >= step)

    def revive(self, engines: list[int]) -> None:
        """Take engines back (restarted, and holding the current weights): they get work again at once."""
        self.engines.revive(engines)

    def leave(self, engines: list[int], left: bool = True, counted: bool = True) -> None:
        """Engines leaving (their node drains: the next step's rollout/engine_leaves), not placed yet
        (`counted=False`), or found dead while idle (`left=False`, their node lost): no work until `revive`."""
        self.leaves_between += sum(self.engines.lose(e, left=left) and left and counted for e in engines)

    # -- one step ---------------------------------------------------------------------------------------
    async def step(self, step: int, version: int, keep_running: bool = False, after: int | None = None) -> StepResult:
        """One step's batch, to be trained at policy `version` (the staleness of its tokens is counted
        against it). `keep_running`: return at the N-th complete group and leave the rest generating into
        the next step, if that one was asked for by then.
        Steps run one at a time, the lowest asked first: the overlapped mode asks for the next one ahead,
        and it begins the moment the one before it returns. `after`: a step asked just before this one, which
        runs first (an async actor may start two calls in either order; without it, a look-ahead step that
        arrived first would run first)."""
        async with self.order.turn(step, after, lambda: self.running is not None, self.engines.changed):
            return await self._step(step, version, keep_running)

    async def _step(self, step: int, version: int, keep_running: bool) -> StepResult:
        t0 = self.clock()
        if self.running is not None:  # the last step's groups are still on the engines: go on with them
            s, surplus, self.running = self.running.go_on(step, version, t0), self.running.completed, None
            for gid in surplus:  # complete after the last batch closed: this step's first
                self._group_done(s, gid)
        else:
            s = StepState(step, version, (self.run_id, step), EngineLoads(self.pool.capacities), started_s=t0)
        s.engine_leaves, self.leaves_between = s.engine_leaves + self.leaves_between, 0
        for group in await self.store.take_complete():  # surplus of the previous step comes first
            self._register(s, group, dispatch=False)
            self._group_done(s, group.group_id)
        failure = await self._top_up(s)
        s.start_s = self.clock() - t0
        failure = failure or await self._collect(s)
        # Groups keep running only into a step already asked for: one asked later would train their tokens
        # further past the staleness bound than the driver's look-ahead allows (driver/rollout.py).
        keep_running = keep_running and self.schedule.keeps_running and self.order.asked_after(step)
        if failure is None and s.pending and not keep_running:  # N-th group complete: interrupt the rest
            t_nth = self.clock()
            s.abort_resends = await self._interrupt(s)
            s.abort_latency_s = self.clock() - t_nth
            failure = self._call_error(s)
        failure = failure or self._nothing_to_train(s)
        if failure is not None:
            await self._fail(s, failure)
        return await self._finish(s, t0, keep_running)

    async def _collect(self, s: StepState) -> str | None:
        """Results in completion order until N groups are complete; returns why the step cannot finish."""
        while len(s.completed) < self.cfg.rollout_batch_size and (
                s.pending or (s.queue and await self.engines.one_back(self.cfg.engine_wait_s))):
            if not s.pending:
                self._dispatch(s)
                continue
            for fut in await s.completions.wait():
                self._on_result(s, fut)
            failure = self._call_error(s) or self._all_failed(s) or await self._top_up(s)
            if failure:
                return failure
        if len(s.completed) < self.cfg.rollout_batch_size:
            return (f"step {s.step}: no engine came back within rollout.engine_wait_s="
                    f"{self.cfg.engine_wait_s:g}s to finish the rollout")
        return None

    @staticmethod
    def _call_error(s: StepState) -> str | None:
        return f"step {s.step}: an engine call failed: {s.call_errors[0]}" if s.call_errors else None

    def _in_flight_target(self, s: StepState) -> int:
        n = self.cfg.rollout_batch_size
        if len(s.completed) >= n:
            return 0
        return self.schedule.num_to_start(n, self.over_sampling.batch_size, len(s.completed), s.num_incomplete,
                                          started=bool(s.num_fresh + s.num_resumed))

    async def _top_up(self, s: StepState) -> str | None:
        """Fill the in-flight set back up to its target (store first) and dispatch; returns a failure."""
        need = self._in_flight_target(s)
        if need > 0 and len(s.dropped) > self.cfg.max_filtered_groups:
            raised = sum(r == "episode_error" for r in s.dropped.values())
            if raised:
                return (f"step {s.step}: {len(s.dropped)} groups were dropped, {raised} of them because an episode "
                        f"raised (rollout.max_filtered_groups); the first error: {s.first_failure}")
            return (f"step {s.step}: the dynamic filter dropped {len(s.dropped)} groups (all rewards equal) and "
                    f"only {len(s.completed)} of {self.cfg.rollout_batch_size} were kept; the task is too easy "
                    f"or too hard for the policy (raise rollout.max_filtered_groups or disable rollout.dynamic_filter)")
        if need > 0:
            groups = [] if s.store_empty else await self.store.take_partial(need, s.version)
            s.store_empty = len(groups) < need
            s.num_resumed += len(groups)
            s.num_episodes_resumed += sum(m.state == SampleState.PARTIAL and m.in_episode
                                          for g in groups for m in g.metas)
            fresh = await self.source.take(need - len(groups), s.step) if need > len(groups) else []
            s.num_fresh += len(fresh)
            for g in groups + [held(g, g.samples) for g in fresh]:  # a fresh sample is a prompt: sent as a value
                self._register(s, g, dispatch=True)
        self._dispatch(s)
        return None

    def _register(self, s: StepState, group: HeldGroup, dispatch: bool) -> None:
        assert group.group_id not in s.flights, f"group {group.group_id} is in flight twice"
        flight = s.flights[group.group_id] = Flight.of(group)
        for i, meta in enumerate(group.metas):
            if meta.state == SampleState.FINISHED:
                flight.metas[i] = self.finished_metas.get(meta.sample_id, meta)
                flight.handles[i] = self.finished_handles.get(meta.sample_id, group.handles[i])
        if dispatch and not flight.complete:
            s.queue.append(group.group_id)

    def _dispatch(self, s: StepState) -> None:
        """Send each queued group's unfinished samples, in one call, to the least-loaded live engine, or
        back to the engine it last ran on while that one has room (its KV caches may be parked there).

        One call per group, not per sample: a group is the unit of completion, and Ray's per-call cost
        would otherwise rival a tiny model's decode step. The engine's own scheduler enforces its
        concurrency cap (excess requests wait in its queue, as on an SGLang server). Each call carries all
        of its group's unfinished samples, so the call in which they finish completes the group: with
        task.reward_per_group it also carries the finished ones' handles, for the group function.
        """
        while s.queue:
            flight = s.flights[s.queue[0]]
            idx = [i for i, st in enumerate(flight.states) if st != SampleState.FINISHED]
            finished = [i for i, st in enumerate(flight.states) if st == SampleState.FINISHED]
            context = finished if self.pool.reward_per_group else []
            engine = flight.engine
            if engine < 0 or not self.alive[engine] or s.load[engine] + len(idx) > self.pool.capacities[engine]:
                engine = s.load.least(self.alive)
                if engine is None:  # every engine is dead: the group waits for one to come back
                    return
            gid = s.queue.popleft()
            flight.engine = engine
            fut, handles = self.pool.generate(engine, [flight.handles[i] for i in idx], s.token,
                                              [flight.handles[i] for i in context])
            fut = asyncio.ensure_future(fut)
            s.pending[fut] = Call(gid, idx, engine, handles, self.clock(), context)
            s.completions.watch(fut)
            for i in idx:
                flight.states[i] = SampleState.RUNNING
            s.load.add(engine, len(idx))

    def _on_result(self, s: StepState, fut: asyncio.Future) -> None:
        call = s.pending.pop(fut)
        s.load.add(call.engine, -len(call.indices))
        flight = s.flights[call.group_id]
        try:
            metas = fut.result()
        except Exception as e:  # the samples keep the state and handles they were sent with
            for i in call.indices:
                flight.states[i] = (flight.metas[i] or flight.group.metas[i]).state
            if isinstance(e, EngineLeft):  # it handed back its samples with every token: no loss
                s.engine_leaves += self.engines.lose(call.engine, left=True)
                s.queue.appendleft(call.group_id)
            elif isinstance(e, EngineFailure):  # resend them to a live engine
                self._lost(s, call)
                s.queue.appendleft(call.group_id)
            else:  # a bug or a bad sample: not resent; the step stores everything, then fails
                s.call_errors.append(f"group {call.group_id} on engine {call.engine}: {e!r}")
            return
        # A call that completed its group under task.reward_per_group returns its context samples too,
        # rewarded: their handles and metas replace the unrewarded ones (and so reach the store's cache).
        indices = call.indices + call.context if len(metas) > len(call.indices) else call.indices
        for i, handle, meta in zip(indices, call.handles, metas):
            flight.handles[i], flight.metas[i], flight.states[i] = handle, meta, meta.state
            s.generated_tokens += meta.num_new_tokens
        s.sample_seconds += len(call.indices) * (self.clock() - max(call.sent_s, s.started_s))
        self.heard_s[call.engine] = self.clock()
        if flight.complete:
            self._group_done(s, call.group_id)
        elif len(s.completed) < self.cfg.rollout_batch_size:
            s.queue.append(call.group_id)  # aborted by someone else before our interrupt: resume it

    def _lost(self, s: StepState, call: Call) -> None:
        """A call died with its engine: count the crash (once per death) and the tokens thrown away.

        The dead process takes its counters with it, so the tokens are estimated, as a lower bound: the
        call's seconds on the engine up to the last time the engine returned anything (it was alive then;
        Ray reports a death about a second later), times its samples, times the per-sequence token rate of
        the calls this step returned (the last step's before any returned). A call sent to an engine that
        was already dead, or restarted without the current weights, adds nothing."""
        if self.engines.lose(call.engine):
            s.engine_crashes += 1
            self.num_engine_crashes += 1
        rate = s.generated_tokens / s.sample_seconds if s.sample_seconds else self.token_rate
        s.crash_tokens_lost += len(call.indices) * rate * max(0.0, self.heard_s[call.engine] - call.sent_s)

    def _group_done(self, s: StepState, gid: str) -> None:
        """A complete group goes to the batch, unless an episode of it raised (`episode_error`: a broken
        environment must not teach the policy) or the dynamic filter drops it."""
        metas = s.flights[gid].metas
        errors = {m.sample_id: m.error for m in metas if m.error}
        failures = [m.error or m.reward_error for m in metas if m.error or m.reward_error]
        s.num_groups_done += 1
        s.num_groups_failed += len(failures) == len(metas)
        s.first_failure = s.first_failure or next(iter(failures), None)
        s.episode_errors |= errors
        reason = "episode_error" if errors else filter_reason(metas) if self.cfg.dynamic_filter else None
        if reason is not None:
            s.dropped[gid] = reason
        else:
            s.completed.append(gid)

    def _all_failed(self, s: StepState) -> str | None:
        """Every sample of the step's first N complete groups failed (its episode raised, or its reward call
        failed): the environment or the reward is broken, and there is nothing to train."""
        if s.num_groups_failed < self.cfg.rollout_batch_size or s.num_groups_failed < s.num_groups_done:
            return None
        return (f"step {s.step}: every sample of the {s.num_groups_done} groups that finished failed; nothing to "
                f"train. The first error: {s.first_failure}")

    def _nothing_to_train(self, s: StepState) -> str | None:
        """A batch without one model token (an episode that never calls `ep.generate`)."""
        batch = s.completed[:self.cfg.rollout_batch_size]
        if not batch or any(m.response_len for g in batch for m in s.flights[g].metas):
            return None
        episodes = " (rollout.episode_fn: does the episode call ep.generate?)" if self.cfg.episode_fn else ""
        return f"step {s.step}: no model token was generated in the batch's {len(batch)} groups{episodes}"

    async def _interrupt(self, s: StepState) -> int:
        """Abort every engine and wait until every outstanding call has resolved; returns re-sends."""
        s.queue.clear()  # undispatched samples stay as they are, in their groups
        await self.pool.abort_all(s.token, self.engines.live())
        resends = 0
        while s.pending:
            done = await s.completions.wait(self.cfg.abort_resend_s)
            if not done:
                resends += 1
                await self.pool.abort_all(s.token, self.engines.live())
            for fut in done:
                self._on_result(s, fut)
            s.queue.clear()
        return resends

    # -- the doors out of a step ------------------------------------------------------------------------
    async def _finish(self, s: StepState, t0: float, keep_running: bool) -> StepResult:
        n = self.cfg.rollout_batch_size
        batch, surplus = s.completed[:n], s.completed[n:]
        t_store = self.clock()
        keep = self.schedule.keeps_leftovers
        discarded = [] if keep else s.partial_ids() + surplus
        running = surplus + s.partial_ids() if keep_running else []
        partial = [] if keep_running else await self._stash(s, surplus if keep else [], with_partial=keep)
        self.num_returned_groups += len(batch)
        self.num_dropped_groups += len(s.dropped) + len(discarded)
        metas = [list(s.flights[g].metas) for g in batch]
        staleness = batch_staleness(metas, s.version)
        wall = self.clock() - t0
        slots = sum(c for c, ok in zip(self.pool.capacities, self.alive) if ok)
        metrics = step_metrics(s, metas, staleness, wall=wall, store_s=self.clock() - t_store)
        metrics |= over_sampling_metrics(s, staleness, wall, slots, self.over_sampling.factor, self.staleness.trains)
        self.over_sampling.observe(metrics["rollout/occupancy"], metrics["rollout/masked_token_ratio"])
        metrics |= {"rollout/groups_surplus": len(surplus) if keep else 0, "rollout/groups_partial": len(partial),
                    "rollout/groups_running": len(running), "rollout/groups_discarded": len(discarded),
                    "engines/live": sum(self.alive),
                    "rollout/discarded_tokens": sum(m.response_len for g in discarded for m in s.flights[g].metas if m)}
        if s.sample_seconds:
            self.token_rate = s.generated_tokens / s.sample_seconds
        self._forget((*batch, *s.dropped, *discarded), s)
        errors = {sid: e.strip().splitlines()[-1] for sid, e in s.episode_errors.items()}
        result = StepResult(s.step, [list(s.flights[g].handles) for g in batch], metas, metrics, staleness, batch,
                            dict(s.dropped), [list(s.flights[g].handles) for g in s.dropped], discarded, errors,
                            running)
        if keep_running:
            self.running = s.leaving(batch + list(s.dropped), surplus)
        return result

    async def _fail(self, s: StepState, message: str) -> None:
        """Stop the step without losing a sample: abort and drain, store everything, then raise."""
        if s.pending:
            await self._interrupt(s)
        await self._stash(s, s.completed)
        self.num_dropped_groups += len(s.dropped)
        self._forget(s.dropped, s)
        raise StepFailed(message)

    def _forget(self, group_ids, s: StepState) -> None:
        """The finished samples of groups that left the run (returned, dropped, discarded) no longer come
        back from the store: their handles (each pins its call's result) and metas go."""
        for gid in group_ids:
            for m in s.flights[gid].metas:
                if m is not None:
                    self.finished_handles.pop(m.sample_id, None)
                    self.finished_metas.pop(m.sample_id, None)

    async def _stash(self, s: StepState, complete: list[str], with_partial: bool = True) -> list[str]:
        """Store complete groups not returned, and every unfinished group (unless not `with_partial`);
        returns the ids of the unfinished groups stored."""
        partial = s.partial_ids() if with_partial else []
        errors = {m.sample_id: m.reward_error for g in (*complete, *partial) for m in s.flights[g].metas
                  if m is not None and m.reward_error}  # the samples carry them from here on (rollout/store.py)
        if complete:
            await self.store.put_complete([s.flights[g].as_group() for g in complete], errors)
        if partial:
            await self.store.put_partial([s.flights[g].as_group() for g in partial], errors)
        for f in (s.flights[g] for g in (*complete, *partial)):
            for m, h in zip(f.metas, f.handles):
                if m is not None and m.state == SampleState.FINISHED:
                    self.finished_handles[m.sample_id] = h
                    self.finished_metas[m.sample_id] = replace(m, num_new_tokens=0) if m.num_new_tokens else m
        return partial
