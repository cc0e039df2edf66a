"""The embedded CPU inference engine: continuous batching, abort with partial results, resume.

`LLMEngine` is the synchronous core: `add_request`, `abort`, `step`. Requests join and leave the running
batch at token granularity. An aborted request returns the ids, logprobs and versions it generated so far
(SGLang does the same with finish_reason "abort"), so a caller can resume it by submitting
prompt + generated ids with the remaining budget. Every token is stamped with the policy version of the
weights that sampled it.

With `num_park_slots > 0` an aborted sequence's KV cache is kept in a spare slot, and a later request
whose input is exactly that sequence's tokens restores it instead of re-running the prefill. Whether a
cache computed by older weights may be reused is `max_versions` (0: never; the default), see
`scheduler.ParkedKV` and docs/architecture.md.

Why our own engine and not transformers' `ContinuousBatchingManager`: a cancelled request there yields no
final result, and it measured 2-6x slower than `model.generate` on CPU (docs/architecture.md).
"""
from __future__ import annotations

import time

import torch

from april_ray.batching import padded_chunks
from april_ray.engine.model_runner import ModelRunner, decode_segments, fragmented, grouping_order, sample
from april_ray.engine.scheduler import ParkedKV, Scheduler, Sequence
from april_ray.engine.weight_sync import check_full_update
from april_ray.types import EngineStats, FinishReason, GenerateOutput, GenerateRequest


PREFILL_SPREAD = 2.0


def prefill_chunks(seqs: list[Sequence], max_padded_tokens: int) -> list[list[Sequence]]:
    """Resumed samples run from 10 to 500 tokens: prefill them in length-sorted, budgeted chunks whose
    longest input is at most PREFILL_SPREAD x their shortest. A step-start chunk of fresh prompts padded
    to one resumed sample's 300 tokens cost ~85 ms, a quarter of APRIL's forward time (BENCHMARKS.md);
    a pass more costs a few ms."""
    lengths = [s.num_tokens for s in seqs]
    return [[seqs[i] for i in idx] for idx in padded_chunks(lengths, max_padded_tokens, PREFILL_SPREAD)]


class LLMEngine:
    def __init__(self, model, max_num_seqs: int = 256, max_model_len: int = 640,
                 max_prefill_tokens: int = 8192, seed: int = 0, version: int = 0,
                 num_park_slots: int = 0, max_versions: int = 0):
        self.vocab_size = model.config.vocab_size
        self.max_model_len = max_model_len
        self.runner = ModelRunner(model, max_num_seqs + num_park_slots, max_model_len)
        self.scheduler = Scheduler(max_num_seqs, max_prefill_tokens)
        self.parked = ParkedKV(max_num_seqs, num_park_slots, max_versions=max_versions)
        self.kv_reuse = True
        self.generator = torch.Generator(self.runner.device).manual_seed(seed)
        self.released: set[str] = set()
        self.failed: dict[str, str] = {}
        """Requests whose sampling failed (their distribution was not finite), with why: the caller fails
        each alone (`AsyncEngine` raises ValueError to it) and the batch goes on."""
        """Memory given back by `release_memory` ('kv_cache', 'weights') and not resumed yet."""
        self.version = version
        self.num_generated_tokens = 0
        self.num_prefill_tokens = 0
        self.num_reused_tokens = 0
        self.num_regroups = 0
        self.busy_s = 0.0
        self.cpu_s = 0.0
        self.occupancy: list[tuple[float, int]] = []

    # -- requests -------------------------------------------------------------------------------------
    def add_request(self, request: GenerateRequest) -> None:
        """Validate and queue; a bad request raises ValueError and leaves the engine untouched."""
        ids, sp = request.input_ids, request.sampling
        rid = request.request_id
        if self.released:
            raise ValueError(f"request {rid}: the engine's {' and '.join(sorted(self.released))} memory is "
                             "released; resume it first")
        if not ids:
            raise ValueError(f"request {rid}: input_ids is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"request {rid}: input of {len(ids)} tokens does not fit max_model_len "
                             f"{self.max_model_len} (room for at least one new token is needed)")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"request {rid}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if sp.max_new_tokens <= 0:
            raise ValueError(f"request {rid}: max_new_tokens must be > 0, got {sp.max_new_tokens}")
        if not 0 <= sp.temperature < float("inf") or not 0 < sp.top_p <= 1:
            raise ValueError(f"request {rid}: temperature must be finite and >= 0, and top_p in (0, 1]; got "
                             f"{sp.temperature} and {sp.top_p}")
        budget = min(sp.max_new_tokens, self.max_model_len - len(ids))
        self.scheduler.add(Sequence(request, budget))

    def abort(self, request_id: str, park: bool = True) -> GenerateOutput | None:
        """Stop one request now; its tokens so far come back with finish_reason ABORT. None if unknown.
        `park=False` drops its KV cache even when parking is on."""
        seq = self.scheduler.find(request_id)
        if seq is None:
            return None
        if park and self.kv_reuse and seq.slot >= 0 and seq.num_tokens > 1:
            slot = self.parked.park(seq.request.input_ids + seq.token_ids, seq.kv_version)
            if slot is not None:
                self.runner.copy_slot(seq.slot, slot, seq.num_tokens - 1)
        self._remove(seq)
        return seq.output(FinishReason.ABORT)

    def abort_tagged(self, tag: str) -> list[GenerateOutput]:
        """`abort` every request whose id ends with `tag` (parking their caches), running or waiting."""
        seqs = [s for s in (*self.scheduler.running, *self.scheduler.waiting) if s.request.request_id.endswith(tag)]
        return [self.abort(s.request.request_id) for s in seqs]

    def abort_all(self) -> list[GenerateOutput]:
        return self.abort_tagged("")

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- weights --------------------------------------------------------------------------------------
    def update_weights(self, state_dict: dict[str, torch.Tensor] | None, version: int) -> None:
        """In-place update between steps; tokens sampled from now on carry `version`.

        `state_dict=None` adopts the version only, for weights delivered by another channel (on GPU,
        an NCCL broadcast into the engine's own parameters).

        Running sequences keep the KV cache their old weights computed (SGLang's in-place mode behaves
        the same); the per-token versions record exactly which weights sampled each token.

        All or nothing: every tensor is checked (names, shapes, finite values) before any is copied, so a
        refused update raises ValueError naming the tensor and leaves the weights and version as they were.
        The whole state dict is at hand (the object store's), so nothing is staged: no memory beyond it.

        A version lower than the engine's means the job went back to a checkpoint (driver/restore.py): every
        parked cache goes, since the versions above it named weights the job no longer has, and a cache
        labelled with an older version (its prefill's) may hold positions those weights computed.
        """
        if state_dict is not None:
            check_full_update(self.runner.model, state_dict)
            with torch.no_grad():
                self.runner.model.load_state_dict(state_dict, strict=False)
        if version < self.version:
            self.parked.clear()
        self.version = version
        self.parked.expire(version)

    def flush_cache(self) -> None:
        """Drop every parked KV cache: a resumed request re-prefills (running requests keep theirs)."""
        self.parked.clear()

    def release_memory(self, tags: list[str]) -> None:
        """Give memory back while idle (a colocated learner trains meanwhile): 'kv_cache' frees the KV cache
        (parked caches included), 'weights' frees the parameters' storage, keeping their shapes. Like
        SGLang without a CPU backup, resumed weights are zeros until the next weight update. 'cuda_graph':
        this engine captures none, nothing to free."""
        if self.has_work():
            raise RuntimeError("release_memory: requests are running or waiting")
        tags = set(tags)
        if "kv_cache" in tags and "kv_cache" not in self.released:
            self.parked.clear()
            self.runner.free_cache()
        if "weights" in tags and "weights" not in self.released:
            self._weight_shapes = {n: p.shape for n, p in self.runner.model.named_parameters()}
            for p in self.runner.model.parameters():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.released |= tags & {"kv_cache", "weights"}
        if self.runner.device.type == "cuda":
            torch.cuda.empty_cache()  # back to the device, for a colocated learner

    def resume_memory(self, tags: list[str]) -> None:
        tags = set(tags) & self.released
        if "kv_cache" in tags:
            self.runner.allocate_cache()
        if "weights" in tags:
            params = dict(self.runner.model.named_parameters())
            for name, shape in self._weight_shapes.items():
                p = params[name]
                p.data = torch.zeros(shape, dtype=p.dtype, device=p.device)
        self.released -= tags

    def set_kv_reuse(self, enabled: bool) -> None:
        """Off: aborts park nothing and resumes re-prefill; caches already parked stay for when it is back
        on (a benchmark runs APRIL with and without reuse, interleaved, on the same engines)."""
        self.kv_reuse = enabled

    # -- the loop -------------------------------------------------------------------------------------
    def step(self) -> list[GenerateOutput]:
        """Admit waiting requests; then one pass decodes a token for every running sequence and prefills
        the admitted ones (a resumed one whose KV cache is parked here restores it and just decodes)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        finished: list[GenerateOutput] = []
        fresh = self._admit()
        # Rows [0, n) decode; the fresh inputs sit after them. Every prefill chunk but the last (at a
        # step's start: the fresh prompts, then resumed inputs by length class) runs in a pass of its
        # own; the last one joins the decode pass (mid-step, the one or two prompts that join).
        n = len(self.scheduler.running) - len(fresh)
        chunks = prefill_chunks(fresh, self.scheduler.max_prefill_tokens) if fresh else [[]]
        for chunk in chunks[:-1]:
            finished += self._sample(chunk, self.runner.forward([], [], [], *self._inputs(chunk)))
        decoding, positions, segments = list(self.scheduler.running[:n]), [], []
        if decoding:
            positions = [s.num_tokens - 1 for s in decoding]
            segments = decode_segments(positions)
            if fragmented(positions, segments):
                decoding, positions, segments = self._regroup(n, positions)
        rows = len(self.scheduler.running)
        if decoding or chunks[-1]:
            logits = self.runner.forward([s.last_token for s in decoding], positions, segments,
                                         *self._inputs(chunks[-1]))
            finished += self._sample(decoding + chunks[-1], logits)
        self.busy_s += time.perf_counter() - t0
        self.cpu_s += time.thread_time() - c0
        self.occupancy.append((time.time(), rows))
        return finished

    def _admit(self) -> list[Sequence]:
        """Move waiting requests into slots; those whose cache is parked here get it back. Returns the rest,
        which need a prefill, placed after every decoding row (the restored ones included)."""
        first = len(self.scheduler.running)
        admitted = self.scheduler.admit(self._prefill_cost)
        parked = [self.kv_reuse and self.parked.take(s.request.input_ids, self.version) or None for s in admitted]
        restored = [i for i, e in enumerate(parked) if e is not None]
        fresh = [i for i, e in enumerate(parked) if e is None]
        # The new slots hold nothing yet: renumbering them moves no cache rows.
        self.scheduler.reorder(list(range(first)) + [first + i for i in restored + fresh])
        for i in restored:
            seq, entry = admitted[i], parked[i]
            self.runner.copy_slot(entry.slot, seq.slot, seq.num_tokens - 1)
            seq.kv_version = entry.version
            seq.cached_tokens = seq.num_tokens - 1
            self.num_reused_tokens += seq.num_tokens - 1
        return [admitted[i] for i in fresh]

    def _inputs(self, chunk: list[Sequence]) -> tuple[list[list[int]], list[int]]:
        """A prefill chunk's inputs and slots; counts its tokens and stamps its cache with this version."""
        self.num_prefill_tokens += sum(s.num_tokens for s in chunk)
        for s in chunk:
            s.kv_version = self.version
        return [s.request.input_ids + s.token_ids for s in chunk], [s.slot for s in chunk]

    def _regroup(self, n: int, positions: list[int]):
        """One contiguous range of rows per span class among the n decoding rows (`grouping_order`), so
        the decode attends in a few slices of the cache. Rows keep their places as they all grow by a
        token a step, and fresh prompts join at the end in the shortest class; resumed long sequences
        admitted among short ones, and short ones moved into a finished row's slot, fragment the batch."""
        order = grouping_order(positions)
        moved = [i for i, o in enumerate(order) if o != i]
        if moved:  # always, when fragmented: some class is split, so some row is outside its range
            self.runner.move_rows([order[i] for i in moved], moved, max(positions[order[i]] for i in moved))
        self.scheduler.reorder(order + list(range(n, len(self.scheduler.running))))
        self.num_regroups += 1
        positions = [positions[i] for i in order]
        return list(self.scheduler.running[:n]), positions, decode_segments(positions)

    def _prefill_cost(self, seq: Sequence) -> int:
        hit = self.kv_reuse and self.parked.usable(seq.request.input_ids, self.version)
        return 1 if hit else seq.num_tokens

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[GenerateOutput]:
        params, dev = [s.request.sampling for s in seqs], logits.device
        tokens, logprobs, ok = sample(
            logits,
            torch.tensor([p.temperature for p in params], device=dev),
            torch.tensor([p.top_p for p in params], device=dev),
            torch.tensor([p.top_k for p in params], device=dev),
            self.generator,
        )
        self.num_generated_tokens += len(seqs)
        done = []
        for seq, tok, lp, good in zip(seqs, tokens.tolist(), logprobs.tolist(), ok.tolist()):
            if not good:
                self._remove(seq)
                self.failed[seq.request.request_id] = (f"request {seq.request.request_id}: sampling failed: the "
                                                       f"distribution at temperature {seq.request.sampling.temperature} "
                                                       "is not finite")
                continue
            reason = seq.append(tok, lp, self.version)
            if reason is not None:
                self._remove(seq)
                done.append(seq.output(reason))
        return done

    def _remove(self, seq: Sequence) -> None:
        move = self.scheduler.remove(seq)
        if move is not None:
            src, dst = move
            self.runner.copy_slot(src, dst, self.scheduler.running[dst].num_tokens)

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateOutput]:
        """Offline convenience: run to completion, outputs in request order."""
        for r in requests:
            self.add_request(r)
        outputs = {}
        while self.has_work():
            for out in self.step():
                outputs[out.request_id] = out
        if self.failed:
            raise ValueError("; ".join(self.failed.values()))
        return [outputs[r.request_id] for r in requests]

    def stats(self, drain: bool = True) -> EngineStats:
        occupancy = self.occupancy
        if drain:
            self.occupancy = []
        return EngineStats(self.num_generated_tokens, self.num_prefill_tokens, self.busy_s,
                           len(self.scheduler.running), len(self.scheduler.waiting), self.version, occupancy,
                           self.num_reused_tokens, len(self.parked), self.cpu_s)
