"""Continuous-batching bookkeeping for the CPU engine: which sequences run, in which KV-cache slot.

No torch here. Running sequences stay packed in slots 0..n-1, so the model runner reads the cache of the
whole batch as one contiguous view; when a sequence leaves, the last one moves into its slot (the
returned move tells the runner which cache rows to copy).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from april_ray.config import within_versions
from april_ray.types import FinishReason, GenerateOutput, GenerateRequest


@dataclass
class Sequence:
    request: GenerateRequest
    max_new_tokens: int
    """The request's budget, clamped to what fits in the context."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    slot: int = -1
    kv_version: int = -1
    """Oldest weights version that computed any of this sequence's cached keys and values."""
    cached_tokens: int = 0
    """Input tokens restored from a parked cache instead of prefilled."""

    @property
    def num_tokens(self) -> int:
        return len(self.request.input_ids) + len(self.token_ids)

    @property
    def last_token(self) -> int:
        return self.token_ids[-1] if self.token_ids else self.request.input_ids[-1]

    def append(self, token: int, logprob: float, version: int) -> FinishReason | None:
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if token in self.request.sampling.stop_token_ids:
            return FinishReason.STOP
        if len(self.token_ids) >= self.max_new_tokens:
            return FinishReason.LENGTH
        return None

    def output(self, reason: FinishReason) -> GenerateOutput:
        return GenerateOutput(self.request.request_id, self.token_ids, self.logprobs, self.versions, reason,
                              self.cached_tokens)


class Scheduler:
    def __init__(self, max_num_seqs: int, max_prefill_tokens: int):
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.ids: set[str] = set()

    def add(self, seq: Sequence) -> None:
        rid = seq.request.request_id
        if rid in self.ids:
            raise ValueError(f"request_id {rid!r} is already in the engine")
        self.ids.add(rid)
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self, cost=lambda seq: seq.num_tokens) -> list[Sequence]:
        """Move waiting sequences into free slots, within the prefill token budget (at least one).
        `cost(seq)`: the tokens its prefill will run (fewer when its cache is restored)."""
        admitted, budget = [], self.max_prefill_tokens
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            c = cost(seq)
            if admitted and c > budget:
                break
            budget -= c
            seq.slot = len(self.running)
            self.running.append(self.waiting.popleft())
            admitted.append(seq)
        return admitted

    def remove(self, seq: Sequence) -> tuple[int, int] | None:
        """Take `seq` out; returns the (src, dst) slot move that keeps the running batch packed."""
        self.ids.discard(seq.request.request_id)
        if seq.slot < 0:
            self.waiting.remove(seq)
            return None
        last = self.running.pop()
        move = None
        if last is not seq:
            move = (last.slot, seq.slot)
            last.slot = seq.slot
            self.running[seq.slot] = last
        seq.slot = -1
        return move

    def reorder(self, order: list[int]) -> None:
        """The running batch becomes the old running[order] (the runner moves the cache rows to match)."""
        assert sorted(order) == list(range(len(self.running))), "reorder needs a permutation of the running batch"
        self.running = [self.running[i] for i in order]
        for slot, seq in enumerate(self.running):
            seq.slot = slot

    def find(self, request_id: str) -> Sequence | None:
        if request_id not in self.ids:
            return None
        return next(s for s in (*self.running, *self.waiting) if s.request.request_id == request_id)


@dataclass
class ParkedEntry:
    slot: int
    version: int
    """Oldest weights version that computed this cache."""
    count: int = 1
    """Parked sequences with exactly these tokens: one cache serves them all, one `take` each."""


class ParkedKV:
    """KV caches of aborted sequences, kept in spare slots so that resuming them skips the prefill.

    APRIL resumes an interrupted sample by sending prompt + its tokens again; without this the engine
    recomputes that whole prefix. Entries are keyed by the exact token ids (the resumed request's input
    is the aborted sequence's tokens, so a hit is an exact match) and cache every position but the last
    (which the next decode step feeds). Several aborted sequences may carry the same ids (samples of one
    prompt often begin alike): they share one entry and one slot, counted, each resume takes it once, and
    the slot is freed after the last. Entries are evicted oldest parked first when the spare slots run
    out, and reusable while the weights are at most `max_versions` versions newer than the ones that
    computed them (0: only the very same weights, an exact prefix cache): the one staleness rule,
    `config.within_versions`, under the bound `StalenessConfig.kv_max_versions` gives the engine.
    """

    def __init__(self, first_slot: int, num_slots: int, max_versions: int):
        self.free = list(range(first_slot + num_slots - 1, first_slot - 1, -1))
        self.max_versions = max_versions
        self.entries: OrderedDict[tuple[int, ...], ParkedEntry] = OrderedDict()

    def __len__(self) -> int:
        """Parked sequences (those sharing one cache counted each)."""
        return sum(e.count for e in self.entries.values())

    def park(self, tokens: list[int], version: int) -> int | None:
        """The slot to copy this sequence's cache into (evicting the oldest entry if needed); None when
        there is nothing to copy: no spare slots at all, or a cache of these tokens by weights as new or
        newer is parked already (it serves this sequence too)."""
        key = tuple(tokens)
        entry = self.entries.get(key)
        if entry is not None:
            entry.count += 1
            self.entries.move_to_end(key)
            if version <= entry.version:
                return None
            entry.version = version  # the fresher cache is copied over the parked one
            return entry.slot
        if not self.free and self.entries:
            self.free.append(self.entries.popitem(last=False)[1].slot)
        if not self.free:
            return None
        slot = self.free.pop()
        self.entries[key] = ParkedEntry(slot, version)
        return slot

    def usable(self, tokens: list[int], version: int) -> ParkedEntry | None:
        if not self.entries:  # the common case, and always without spare slots: no key to build
            return None
        entry = self.entries.get(tuple(tokens))
        return entry if entry is not None and within_versions(version - entry.version, self.max_versions) else None

    def take(self, tokens: list[int], version: int) -> ParkedEntry | None:
        """The entry for this exact input, taken once: removed with its last sequence (its slot is free
        once the caller has copied it)."""
        entry = self.usable(tokens, version)
        if entry is not None:
            entry.count -= 1
            if not entry.count:
                del self.entries[tuple(tokens)]
                self.free.append(entry.slot)
        return entry

    def clear(self) -> None:
        for entry in self.entries.values():
            self.free.append(entry.slot)
        self.entries.clear()

    def expire(self, version: int) -> None:
        for key in [k for k, e in self.entries.items() if not within_versions(version - e.version, self.max_versions)]:
            self.free.append(self.entries.pop(key).slot)
