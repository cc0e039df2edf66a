"""Continuous-batching bookkeeping for the CPU engine: which sequences run, in which KV-cache slot.

No torch here. Running sequences stay packed in slots 0..n-1, so the model runner reads the cache of the
whole batch as one contiguous view; when a sequence leaves, the last one moves into its slot (the
returned move tells the runner which cache rows to copy).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

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
        return GenerateOutput(self.request.request_id, self.token_ids, self.logprobs, self.versions, reason)


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

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into free slots, within the prefill token budget (at least one)."""
        admitted, budget = [], self.max_prefill_tokens
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if admitted and seq.num_tokens > budget:
                break
            budget -= seq.num_tokens
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

    def find(self, request_id: str) -> Sequence | None:
        if request_id not in self.ids:
            return None
        return next(s for s in (*self.running, *self.waiting) if s.request.request_id == request_id)
