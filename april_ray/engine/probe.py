"""Saturated throughput of an engine on a workload: the ceiling the rollout benchmarks measure against.

`concurrency` requests are kept running, each finished one replaced at once by the next prompt (with the
real stop token and budget), and the tokens decoded over `seconds` after `warmup_s` are counted (the
lanes start in lockstep, so the warm-up lets them spread out). The requests still running at the end are
aborted without parking, so the probe has no draining tail of its own and leaves parked caches alone.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time

from april_ray.types import GenerateRequest, SamplingParams


async def saturated_throughput(engine, prompts: list[list[int]], sampling: SamplingParams, concurrency: int,
                               seconds: float, warmup_s: float = 1.0) -> tuple[int, float, float, float]:
    """(tokens, seconds, mean running rows per step, this process's CPU seconds meanwhile) on an async
    `Engine`. The CPU is the whole process's (`time.process_time`): for an engine served in this process it
    is the engine's own time, without what other processes took of the core."""
    counter = itertools.count()
    running: set[str] = set()
    stop = False

    async def lane() -> None:
        while not stop:
            i = next(counter)
            rid = f"probe-{i}"
            running.add(rid)
            await engine.generate(GenerateRequest(rid, prompts[i % len(prompts)], dataclasses.replace(sampling)))
            running.discard(rid)

    lanes = [asyncio.ensure_future(lane()) for _ in range(concurrency)]
    await asyncio.sleep(warmup_s)
    st0 = engine.stats(drain=False)
    n0, k0, t0, c0 = st0.num_generated_tokens, len(st0.occupancy), time.perf_counter(), time.process_time()
    await asyncio.sleep(seconds)
    st = engine.stats(drain=False)
    tokens, dt, cpu = st.num_generated_tokens - n0, time.perf_counter() - t0, time.process_time() - c0
    stop = True
    for rid in list(running):
        engine.abort(rid, park=False)
    await asyncio.gather(*lanes)
    rows = [n for _, n in st.occupancy[k0:]]
    return tokens, dt, sum(rows) / max(1, len(rows)), cpu
