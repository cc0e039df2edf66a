"""Per-token log-probabilities of a causal LM without a whole [tokens x vocab] tensor.

The model body runs once to its last (normed) hidden states; the head then runs only on the positions the
loss reads (response tokens), `chunk_tokens` of them at a time, each chunk under activation checkpointing:
a chunk's logits live only while its log-softmax is taken, and are recomputed in backward. For Qwen3's
151,936-token vocabulary one fp32 copy of the logits of a 32,768-token micro-batch is 19.9 GB; a 1,024-token
chunk is 0.6 GB. The log-softmax is always taken in fp32, whatever the model's dtype.

A micro-batch reaches the model in one of two layouts (`Layout`): right-padded rows, or packed (every
sample back to back in one row, positions restarting at each sample, no padding; attention kernels that
read per-sequence positions keep samples apart). Either way the result is in the padded layout that
`learner.collate` builds, so the losses never see the difference.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint


def token_logprobs(model, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log pi(token_{t+1} | tokens_<=t) under softmax(logits / temperature), as the engines sample, at every
    position (the plain path: the whole logits at once)."""
    logits = model(input_ids=input_ids).logits[:, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None])[..., 0]


@dataclass(frozen=True)
class Layout:
    """How a padded micro-batch [rows, width] goes through the model, and where its logits positions land.

    `src` indexes the model's flattened logits positions ([model rows x (model width - 1)]), `dst` the padded
    ones ([rows x (width - 1)]): the log-prob at src[i] belongs at dst[i]."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor | None
    src: torch.Tensor
    dst: torch.Tensor
    shape: tuple[int, int]
    """The padded per-token shape: (rows, width - 1)."""


def padded_layout(input_ids: torch.Tensor, positions: torch.Tensor) -> Layout:
    """The padded rows as they are; `positions` [rows, width - 1] marks the logits positions to score."""
    idx = positions.reshape(-1).nonzero()[:, 0]
    return Layout(input_ids, None, idx, idx, tuple(positions.shape))


def packed_layout(input_ids: torch.Tensor, lengths: list[int], positions: torch.Tensor) -> Layout:
    """Every row's first `lengths[r]` tokens back to back in one row, positions restarting per sample."""
    rows, width = input_ids.shape
    offsets = torch.tensor([0] + lengths[:-1], device=input_ids.device).cumsum(0)
    row, col = positions.nonzero(as_tuple=True)
    packed = torch.cat([input_ids[r, :n] for r, n in enumerate(lengths)])[None]
    position_ids = torch.cat([torch.arange(n, device=input_ids.device) for n in lengths])[None]
    return Layout(packed, position_ids, offsets[row] + col, row * (width - 1) + col, (rows, width - 1))


def num_chunks(num_tokens: int, chunk_tokens: int) -> int:
    """How many head calls score `num_tokens` positions `chunk_tokens` at a time (0: one call, unchunked)."""
    return -(-num_tokens // chunk_tokens) if chunk_tokens > 0 else 0


def selected_logprobs(model, layout: Layout, temperature: float, chunks: int) -> torch.Tensor:
    """Log-probs at the layout's positions, in the padded shape (0 elsewhere), the head run in `chunks`
    checkpointed calls (0: once over every position, not checkpointed). Under ZeRO-3 every call of the head
    gathers its weight, a collective: every rank must make as many calls (`chunks` equal on all ranks)."""
    out = model(input_ids=layout.input_ids, position_ids=layout.position_ids, output_hidden_states=True,
                logits_to_keep=1)  # through the wrapper (DeepSpeed's engine), the head on one position only
    last = out.hidden_states[-1]
    hidden = last[:, :-1].reshape(-1, last.shape[-1])[layout.src]
    targets = layout.input_ids[:, 1:].reshape(-1)[layout.src]
    head = getattr(model, "module", model).get_output_embeddings()
    flat = head_logprobs(head, hidden, targets, temperature, chunks)
    rows, cols = layout.shape
    out = torch.zeros(rows * cols, dtype=flat.dtype, device=flat.device)
    return out.index_put((layout.dst,), flat).view(rows, cols)


def head_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, chunks: int) -> torch.Tensor:
    """log softmax(head(hidden) / temperature)[target] per row of `hidden` [tokens, width], in fp32, in
    `chunks` calls of the head (0: one call, without checkpointing)."""
    if chunks <= 0:
        return _logprobs(head, hidden, targets, temperature)
    parts = zip(hidden.tensor_split(chunks), targets.tensor_split(chunks))
    if not torch.is_grad_enabled():  # nothing to recompute: the chunks bound the memory already
        return torch.cat([_logprobs(head, h, t, temperature) for h, t in parts])
    return torch.cat([checkpoint(_logprobs, head, h, t, temperature, use_reentrant=False) for h, t in parts])


def _logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = head(hidden).float()
    if temperature > 0 and temperature != 1:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]
