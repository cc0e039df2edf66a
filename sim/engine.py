"""A simulated inference engine: continuous batching in virtual time, behind `april_ray.engine.base.Engine`.

The real `EngineWorker` wraps it unchanged. What it keeps of a real engine:
- a running batch capped at `max_num_seqs` rows and by a KV cache of `kv_capacity` tokens: a request waits
  while its input does not fit, and when the growing contexts overflow the cache the newest row is
  retracted to the front of the queue (its tokens kept, its cache dropped: it re-prefills, as SGLang's
  retraction does);
- admission at step boundaries, prefill in the step that admits (at most `max_prefill_tokens` a step,
  one input always; what did not fit joins at the next step), one token per running row per step, every
  token stamped with the weights' version;
- abort: the step in progress completes, then the request returns its tokens so far (finish reason
  ABORT); a resumed request (prompt + earlier tokens, the remaining budget) continues from there. With
  `park_slots`, an aborted row's cache is kept (oldest evicted first; dropped once more than
  `max_versions` versions old) and a resume with exactly those tokens skips its prefill (the CPU
  engine: every position but the last is restored, the decode pass feeds that one).

Time: rows, context and the step cost stay the same between events (an admission, a finish, an abort,
a full cache), so the engine plans a whole span of steps at once and sets one timer for its end; an
event inside a span cuts it at the end of the step in progress. The cost of a span is `StepCost`'s. With
the loop's `stall` on, the span also lasts as long as the loop's clocked work held the thread meanwhile.

Padded attention (a cost with `per_attended`, the CPU engine's): each row attends over the longest
context of its span class (`engine.model_runner.span_bucket`), as the CPU engine's decode does once its
rows are grouped by class; a span starts from that padded total and adds a token per row per step.

Units are the workload's blocks of tokens: one step here is `block` decode steps of the real engine.
"""
from __future__ import annotations

import asyncio
import heapq
from collections import OrderedDict, deque

from april_ray.config import within_versions
from april_ray.types import EngineStats, FinishReason, GenerateOutput, GenerateRequest
from sim.hardware import StepCost

_STOP, _LENGTH = FinishReason.STOP, FinishReason.LENGTH

_REPEATED: dict[tuple[int | float, int], list] = {}
"""Shared output lists by (value, length): token ids and versions (ints >= 0) and the logprob -1.0, so no
two keys of different types are equal."""
_MAX_REPEATED_ITEMS = 1 << 22
_repeated_items = 0


def repeated(value: int | float, n: int) -> list:
    """`[value] * n`, one list per (value, n) shared by every output that needs it (an output's lists are
    read, never changed in place: `Sample.extended` makes a sample's new lists): a new list per output filled
    a large simulation's memory with copies. At most `_MAX_REPEATED_ITEMS` items are kept (32 MB); past
    that the lists are let go."""
    global _repeated_items
    got = _REPEATED.get((value, n))
    if got is None:
        got = _REPEATED[value, n] = [value] * n
        _repeated_items += n
        if _repeated_items > _MAX_REPEATED_ITEMS:
            _REPEATED.clear()
            _repeated_items = 0
    return got


class _Request:
    """One request in the engine. `key`: its sample's id (the key of its parked cache); `todo`: tokens to
    generate before it finishes (unless aborted); `start`: the engine step at which it joined the running
    batch; `mark`: the step since which its tokens carry the current version; `runs`: (version, tokens) of
    the tokens generated so far, older runs first. A plain class with slots: a simulation makes millions."""

    __slots__ = ("request_id", "key", "fut", "input_len", "todo", "reason", "token", "start", "mark", "runs",
                 "kv_version")

    def __init__(self, request_id: str, key: str, fut: asyncio.Future, input_len: int, todo: int,
                 reason: FinishReason, token: int):
        self.request_id, self.key, self.fut = request_id, key, fut
        self.input_len, self.todo, self.reason, self.token = input_len, todo, reason, token
        self.start = self.mark = self.kv_version = 0
        self.runs: list[tuple[int, int]] = []


class _Span:
    """Steps the engine runs between two events. `attended`: padded attention span of the rows at the
    first step, in tokens (0 unless the cost has that term); `decode_s`: the n decode steps' time
    (without prefill and stalls); `poked_at`: when a change last cut the span (more changes at that
    instant cut it at the same step). A plain class with slots: one per event."""

    __slots__ = ("t_start", "rows", "context", "prefill_s", "n", "stall0", "attended", "decode_s", "poked_at")

    def __init__(self, t_start: float, rows: int, context: int, prefill_s: float, n: int, stall0: float,
                 attended: float = 0.0, decode_s: float = 0.0):
        self.t_start, self.rows, self.context, self.prefill_s, self.n = t_start, rows, context, prefill_s, n
        self.stall0, self.attended, self.decode_s, self.poked_at = stall0, attended, decode_s, -1.0


class SimEngine:
    def __init__(self, cost: StepCost, target, max_num_seqs: int, kv_capacity: int, max_prefill_tokens: int,
                 block: int = 1, park_slots: int = 0, max_versions: int = 0, version: int = 0):
        """`target(sample key, input ids) -> (blocks left to generate before the sample's drawn end, token
        id)`, the key being the request id less `EngineWorker`'s `@<step>` tag;
        lengths and capacities are in blocks."""
        self.cost, self.target, self.block = cost, target, block
        self.cap, self.kv_capacity, self.max_prefill = max_num_seqs, kv_capacity, max_prefill_tokens
        self.park_slots, self.max_versions = park_slots, max_versions
        self.version = self.next_version = version
        self.loop = asyncio.get_running_loop()
        self.steps = 0
        self.context = 0
        """Tokens in the running rows' caches after `steps` steps."""
        self.running: dict[str, _Request] = {}
        """By admission, oldest first (the newest is retracted first)."""
        self.finish_heap: list[tuple[int, int, str]] = []
        self.waiting: deque[_Request] = deque()
        self.aborting: dict[str, bool] = {}
        self.parked: OrderedDict[tuple[str, int], int] = OrderedDict()
        self.span: _Span | None = None
        self.timer = None
        self.t_free = 0.0
        """When the last span ended (the next one starts then, or on arrival if idle)."""
        self.num_generated = self.num_prefill = self.num_reused = self.num_retracted = 0
        self.busy_s = self.row_seconds = 0.0
        self.num_requests = self.num_spans = 0
        """Requests received; spans run (each ends at an event: the simulation's unit of engine work)."""
        self.context_steps = 0
        """Context per running row summed over rows and steps (over `row_steps`: the mean context)."""
        self.attended_steps = 0.0
        """Padded attention span summed over steps, in tokens (with a `per_attended` cost)."""
        self.peak_context = 0
        self.occupancy: list[tuple[float, int]] = []
        self._seq = 0
        self.prefill_full = False
        """The last admission left requests waiting for want of prefill budget: the next step admits again."""
        self.span_class = None
        if cost.per_attended:
            from april_ray.engine.model_runner import span_bucket
            self.span_class = span_bucket

    @property
    def num_steps(self) -> int:
        """Steps run (one token per running row each): the step counter, which starts at 0."""
        return self.steps

    @property
    def row_steps(self) -> int:
        """Rows summed over steps: a running row decodes one token a step, so the tokens generated."""
        return self.num_generated

    # -- the Engine protocol ----------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        key = request.request_id.rpartition("@")[0] or request.request_id  # `Workload.sample_key`, inline
        left, token = self.target(key, request.input_ids)
        budget, n_in = request.sampling.max_new_tokens, len(request.input_ids)
        if budget <= 0 or not n_in:
            raise ValueError(f"request {request.request_id}: needs input ids and max_new_tokens > 0")
        todo = max(1, left)
        new = min(todo, budget)
        if n_in + new > self.kv_capacity:
            raise ValueError(f"request {request.request_id}: {n_in} blocks of input and up to {new} new ones do "
                             f"not fit the KV cache of {self.kv_capacity} blocks")
        fut = self.loop.create_future()
        self.num_requests += 1
        self.waiting.append(_Request(request.request_id, key, fut, n_in, new, _STOP if todo <= budget else _LENGTH,
                                     token))
        self._poke()
        try:
            return await fut
        except asyncio.CancelledError:  # the caller gave up: free the row, as the real engines do
            self.abort(request.request_id)
            raise

    def abort(self, request_id: str, park: bool = True) -> bool:
        for r in self.waiting:
            if r.request_id == request_id:
                self.waiting.remove(r)
                self._resolve(r, FinishReason.ABORT)
                return True
        if request_id in self.running:
            self.aborting[request_id] = park
            self._poke()
            return True
        return False

    def abort_tagged(self, tag: str) -> int:
        waiting = [r for r in self.waiting if r.request_id.endswith(tag)]
        running = [rid for rid in self.running if rid.endswith(tag)]
        self.waiting = deque(r for r in self.waiting if not r.request_id.endswith(tag))
        for r in waiting:
            self._resolve(r, FinishReason.ABORT)
        for rid in running:
            self.aborting.setdefault(rid, True)
        if running:
            self._poke()
        return len(waiting) + len(running)

    def abort_all(self) -> int:
        return self.abort_tagged("")

    def update_weights(self, state_dict, version: int) -> None:
        """Weights are not simulated; tokens from the next step boundary carry `version`."""
        self.next_version = version
        if self.span is None and self.timer is None:
            self._set_version(version)
        else:
            self._poke()

    def _set_version(self, version: int) -> None:
        """Adopt the weights of `version`; parked caches now too stale to reuse free their slots (as the
        CPU engine's `ParkedKV.expire`)."""
        self.version = version
        for key in [k for k, v in self.parked.items() if not within_versions(version - v, self.max_versions)]:
            del self.parked[key]

    def set_kv_reuse(self, enabled: bool) -> None:
        self.park_slots = self.park_slots if enabled else 0

    def stats(self, drain: bool = True) -> EngineStats:
        occupancy = self.occupancy
        if drain:
            self.occupancy = []
        return EngineStats(num_generated_tokens=self.num_generated, num_prefill_tokens=self.num_prefill,
                           busy_s=self.busy_s, num_running=len(self.running), num_waiting=len(self.waiting),
                           version=self.version, occupancy=occupancy, num_reused_tokens=self.num_reused,
                           num_parked=len(self.parked))

    # -- events -----------------------------------------------------------------------------------------
    def _poke(self) -> None:
        """Something changed: handle it at the end of the step in progress (now, if idle)."""
        if self.timer is None:
            self.timer = self.loop.call_at(max(self.loop.time(), self.t_free), self._boundary)
            return
        s, now = self.span, self.loop.time()
        if s is None or s.n <= 1 or s.poked_at == now:
            return
        s.poked_at = now
        elapsed = now - s.t_start - s.prefill_s - (self.loop.stall_s - s.stall0 if self.loop.stall else 0)
        done = self.cost.steps_within(s.rows, s.context * self.block, s.n * self.block, max(0.0, elapsed),
                                      s.attended) // self.block
        if done + 1 < s.n:
            self._set_steps(s, done + 1)
            self.timer.cancel()
            self.timer = self.loop.call_at(self._span_end(s), self._boundary)

    def _set_steps(self, s: _Span, n: int) -> None:
        s.n = n
        s.decode_s = self.cost.decode_span(s.rows, s.context * self.block, n * self.block, s.attended)

    def _attended(self) -> float:
        """The running rows' padded attention span, in tokens: per span class, its rows x its longest
        context (a row at position p attends over p + 1 tokens: its context)."""
        longest: dict[int, list[int]] = {}
        for r in self.running.values():
            t = (r.input_len + self.steps - r.start) * self.block
            c = longest.setdefault(self.span_class(t - 1), [0, 0])
            c[0], c[1] = c[0] + 1, max(c[1], t)
        return float(sum(n * t for n, t in longest.values()))

    def _span_end(self, s: _Span) -> float:
        end = s.t_start + s.prefill_s + s.decode_s
        return end + (self.loop.stall_s - s.stall0 if self.loop.stall else 0.0)

    def _boundary(self) -> None:
        self.timer = None
        s = self.span
        if s is not None:
            end = s.t_start + s.prefill_s + s.decode_s  # `_span_end`, inline (a boundary per event)
            if self.loop.stall:
                end += self.loop.stall_s - s.stall0
            if end > self.loop.time() + 1e-12:  # the thread was held up meanwhile: the span ends later
                self.timer = self.loop.call_at(end, self._boundary)
                return
            self._advance(s, end)
        self._retire()
        if self.next_version != self.version:
            for r in self.running.values():
                self._close_run(r)
            self._set_version(self.next_version)
        self._admit()
        self._plan(continuing=s is not None)

    def _advance(self, s: _Span, end: float) -> None:
        self.span = None
        rows, n, dt = s.rows, s.n, end - s.t_start
        self.steps += n
        self.context = context = self.context + rows * n
        if context > self.peak_context:
            self.peak_context = context
        self.num_generated += rows * n
        self.busy_s += dt
        self.row_seconds += rows * dt
        self.num_spans += 1
        self.context_steps += s.context * n + rows * n * (n - 1) // 2
        if s.attended:
            self.attended_steps += s.attended * n + rows * self.block * n * (n - 1) / 2
        self.occupancy.append((end, rows))
        self.t_free = end

    def _retire(self) -> None:
        """Resolve finished rows, then aborted ones (with their tokens so far)."""
        heap, running, steps = self.finish_heap, self.running, self.steps
        while heap and heap[0][0] <= steps:
            rid = heapq.heappop(heap)[2]
            r = running.get(rid)
            if r is not None and r.start + r.todo == steps:  # `_remove`, inline: it generated all of `todo`
                del running[rid]
                self.context -= r.input_len + r.todo
                if steps > r.mark:
                    r.runs.append((self.version, steps - r.mark))
                r.mark = steps
                r.input_len += r.todo
                r.todo = 0
                self._resolve(r, r.reason)
        if not self.aborting:
            return
        for rid, park in self.aborting.items():
            r = self.running.get(rid)
            if r is not None:
                self.t_free += self.cost.per_aborted  # the engine's time to let it go
                self._remove(r)
                if park and self.park_slots:
                    self._park(r)
                self._resolve(r, FinishReason.ABORT)
        self.aborting.clear()

    def _remove(self, r: _Request) -> None:
        del self.running[r.request_id]
        steps = self.steps
        generated = steps - r.start
        self.context -= r.input_len + generated
        if steps > r.mark:  # `_close_run`, inline (every request leaves through here)
            r.runs.append((self.version, steps - r.mark))
        r.mark = steps
        r.input_len += generated
        r.todo -= generated

    def _close_run(self, r: _Request) -> None:
        if self.steps > r.mark:
            r.runs.append((self.version, self.steps - r.mark))
        r.mark = self.steps

    def _park(self, r: _Request) -> None:
        self.parked[(r.key, r.input_len)] = r.kv_version
        while len(self.parked) > self.park_slots:
            self.parked.popitem(last=False)

    def _resolve(self, r: _Request, reason: FinishReason) -> None:
        if r.fut.done():
            return
        if len(r.runs) == 1:
            v, n = r.runs[0]
            versions = repeated(v, n)
        else:
            versions = []
            for v, c in r.runs:
                versions += [v] * c
            n = len(versions)
        r.fut.set_result(GenerateOutput(r.request_id, repeated(r.token, n), repeated(-1.0, n), versions, reason))

    def _admit(self) -> None:
        self.prefill_full = False
        waiting, running, cap = self.waiting, self.running, self.cap
        if not waiting or len(running) >= cap:  # most boundaries: nothing to admit, or no row free
            self._prefill_s = 0.0
            return
        parked, heap, steps, version, block = self.parked, self.finish_heap, self.steps, self.version, self.block
        kv_free, max_prefill, context, seq = self.kv_capacity - 1, self.max_prefill, self.context, self._seq
        prefill, inputs, admitted, restored = 0, [], 0, 0
        while waiting and len(running) < cap:
            r = waiting[0]
            n_in = r.input_len
            hit = parked.get((r.key, n_in)) if parked else None
            reuse = hit is not None and within_versions(version - hit, self.max_versions)
            if context + n_in + len(running) > kv_free:
                break  # no room in the KV cache: it waits
            if inputs and prefill + (0 if reuse else n_in) > max_prefill:
                self.prefill_full = True  # it joins at the next step, with the next step's budget
                break
            waiting.popleft()
            admitted += 1
            if reuse:
                del parked[(r.key, n_in)]
                self.num_reused += n_in - 1 / block  # the last input token is fed by the decode
                restored += n_in * block - 1
                r.kv_version = hit
            else:
                inputs.append((0, n_in * block))
                r.kv_version = version
                prefill += n_in
            r.start = r.mark = steps
            running[r.request_id] = r
            context += n_in
            seq += 1
            heapq.heappush(heap, (steps + r.todo, seq, r.request_id))
        self.context, self._seq = context, seq
        self.num_prefill += prefill
        self._prefill_s = self.cost.admission(inputs, admitted, restored)

    def _plan(self, continuing: bool) -> None:
        """The next span; a batch that was running goes on from the end of the last one (its boundary may
        be handled late when the clocked control plane held the loop: the engine did not wait for it)."""
        rows = len(self.running)
        if rows == 0:
            self.t_free = max(self.t_free, self.loop.time())
            return
        while (room := (self.kv_capacity - self.context) // rows) < 1:
            assert rows > 1, "one sequence outgrew the KV cache (generate checks input + budget)"
            self._retract()
            rows -= 1
        heap, running = self.finish_heap, self.running
        while True:  # entries of requests that left early (aborted, retracted) are dropped on reaching the top
            end, _, rid = heap[0]
            r = running.get(rid)
            if r is not None and r.start + r.todo == end:
                break
            heapq.heappop(heap)
        n = 1 if self.prefill_full else max(1, min(end - self.steps, room))
        loop, context, block = self.loop, self.context, self.block
        start = self.t_free if continuing else max(self.t_free, loop.time())
        attended = self._attended() if self.span_class else 0.0
        decode_s = self.cost.decode_span(rows, context * block, n * block, attended)
        self.span = _Span(start, rows, context, self._prefill_s, n, loop.stall_s, attended, decode_s)
        # `_span_end` (no stall yet)
        self.timer = loop.call_at(start + self._prefill_s + decode_s, self._boundary)

    def _retract(self) -> None:
        r = self.running[next(reversed(self.running))]
        self._remove(r)
        self.waiting.appendleft(r)
        self.num_retracted += 1

