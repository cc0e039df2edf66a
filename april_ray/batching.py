"""Length-sorted chunking under a padded-token budget, shared by warm-up, engine prefill and the learner.

Long-tailed lengths pad badly: one batch of rows from 10 to 500 tokens costs many times its real size.
"""
from __future__ import annotations


def padded_chunks(lengths: list[int], max_padded_tokens: int, max_spread: float | None = None) -> list[list[int]]:
    """Indices grouped in length order so that rows x longest row stays under the budget (>= 1 row), and,
    with `max_spread`, no row is more than that many times the chunk's shortest (bounded padding)."""
    chunks: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if (chunks and (len(chunks[-1]) + 1) * lengths[i] <= max_padded_tokens
                and (max_spread is None or lengths[i] <= max_spread * lengths[chunks[-1][0]])):
            chunks[-1].append(i)
        else:
            chunks.append([i])
    return chunks
