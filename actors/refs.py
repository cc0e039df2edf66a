"""Handles of samples on Ray, and fetching them.

A `generate_group` call returns two objects: the small metas (read by the monitor) and the list of its
samples. One object per call instead of one per sample halves Ray's per-object work on the monitor, the
busiest control-plane process (measured in BENCHMARKS.md). A sample is then addressed as
`SampleRef(call's list, index)`; whole groups go to one consumer, so a consumer fetches only the calls of
its own groups.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import ray


@dataclass(frozen=True)
class SampleRef:
    ref: ray.ObjectRef
    """A list of samples (one generate_group call's result, or one `ray.put` of several)."""
    index: int


def _refs(handles) -> list:
    return list(dict.fromkeys(h.ref if isinstance(h, SampleRef) else h for h in handles
                              if isinstance(h, (SampleRef, ray.ObjectRef))))


def _pick(values: dict, handles) -> list:
    return [values[h.ref][h.index] if isinstance(h, SampleRef) else values[h] if isinstance(h, ray.ObjectRef) else h
            for h in handles]


def fetch(handles: list) -> list:
    """Values of `handles` (SampleRef, ObjectRef of one sample, or a value), with one batched `ray.get`."""
    refs = _refs(handles)
    return _pick(dict(zip(refs, ray.get(refs))), handles)


async def fetch_async(handles) -> list:
    """`fetch` inside an async actor (awaits instead of blocking its event loop). Ray resolves only
    top-level ObjectRef arguments of a call; a SampleRef, an element of another call's result list, is
    resolved here."""
    refs = _refs(handles)
    return _pick(dict(zip(refs, await asyncio.gather(*refs))), handles)
