"""The logic of an EngineWorker actor: samples in, samples out, around any `engine.base.Engine`.

A sample goes in with its prompt ids and the tokens it already has, and is generated with its remaining
budget; it comes back extended (ids, behaviour logprobs, versions) and, if it finished, rewarded. The
reward is computed here, the moment a sample finishes, so no reward call ever sits on the abort path
(DESIGN-NOTES, item 6).

Aborts are race-free through a step gate: `abort_all(step)` closes the step, and a `generate` for a
closed step that arrives later (it was in flight in Ray's queue when the abort ran) returns at once,
untouched, instead of escaping the abort (DESIGN-NOTES, item 5). A step is any hashable token unique
to one rollout step; the monitor uses (its run id, step number), so a new monitor on the same engines
starts with open steps.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections import deque

from april_ray.config import EngineConfig, RolloutConfig
from april_ray.types import GenerateRequest, Sample, SampleMeta, SampleState, SamplingParams


def sample_meta(sample: Sample, num_new_tokens: int) -> SampleMeta:
    counts: dict[int, int] = {}
    for v in sample.versions:
        counts[v] = counts.get(v, 0) + 1
    return SampleMeta(sample.sample_id, sample.group_id, sample.state, num_new_tokens,
                      len(sample.response_ids), sample.reward, counts)


def build_worker(engine_cfg: EngineConfig, rollout_cfg: RolloutConfig, task_name: str, model_path: str,
                 version: int = 0) -> "EngineWorker":
    """An EngineWorker on the configured engine backend, with the task's reward and the rollout's sampling."""
    from transformers import AutoTokenizer

    from april_ray.engine import build_engine
    from april_ray.rewards import get_reward_fn

    tok = AutoTokenizer.from_pretrained(model_path)
    sampling = SamplingParams(rollout_cfg.temperature, rollout_cfg.top_p, rollout_cfg.top_k,
                              rollout_cfg.max_response_len, (tok.eos_token_id,))
    return EngineWorker(build_engine(engine_cfg, model_path, version),
                        lambda ids: tok.decode(ids, skip_special_tokens=True), get_reward_fn(task_name), sampling)


class EngineWorker:
    def __init__(self, engine, decode, reward_fn, sampling: SamplingParams):
        self.engine = engine
        self.decode = decode
        self.reward_fn = reward_fn
        self.sampling = sampling
        self.closed_steps: deque = deque(maxlen=64)

    async def generate(self, sample: Sample, step) -> tuple[SampleMeta, Sample]:
        if step in self.closed_steps:
            return sample_meta(sample, 0), sample
        sample = dataclasses.replace(sample, num_resumes=sample.num_resumes + bool(sample.response_ids))
        sp = dataclasses.replace(self.sampling, max_new_tokens=sample.remaining_budget)
        out = await self.engine.generate(GenerateRequest(f"{sample.sample_id}@{step}", sample.input_ids, sp))
        sample.extend(out)
        if sample.state == SampleState.FINISHED:
            text = self.decode(sample.response_ids)
            sample.reward = float(self.reward_fn(sample.prompt, text, sample.answer))
        return sample_meta(sample, out.num_tokens), sample

    async def generate_group(self, samples: list[Sample], step) -> tuple[list[SampleMeta], list[Sample]]:
        results = await asyncio.gather(*[self.generate(s, step) for s in samples])
        return [m for m, _ in results], [s for _, s in results]

    async def throughput_probe(self, prompts: list[list[int]], concurrency: int, seconds: float,
                               warmup_s: float = 1.0) -> tuple[int, float]:
        """Saturated throughput on this workload: (tokens, seconds) decoded while `concurrency` requests
        are kept running, each finished one replaced at once by the next prompt (real stop token and
        budget). Counted over `seconds` after `warmup_s` (the lanes start in lockstep); the requests still
        running then are aborted without parking, so the probe has no draining tail of its own and leaves
        the parked caches alone."""
        counter = itertools.count()
        running: set[str] = set()
        stop = False

        async def lane() -> None:
            while not stop:
                i = next(counter)
                rid = f"probe-{i}"
                running.add(rid)
                await self.engine.generate(GenerateRequest(rid, prompts[i % len(prompts)], self.sampling))
                running.discard(rid)

        lanes = [asyncio.ensure_future(lane()) for _ in range(concurrency)]
        await asyncio.sleep(warmup_s)
        n0, t0 = self.engine.stats(drain=False).num_generated_tokens, time.perf_counter()
        await asyncio.sleep(seconds)
        tokens, dt = self.engine.stats(drain=False).num_generated_tokens - n0, time.perf_counter() - t0
        stop = True
        for rid in list(running):
            self.engine.abort(rid, park=False)
        await asyncio.gather(*lanes)
        return tokens, dt

    async def evaluate(self, items: list[tuple[str, list[int], str]], temperature: float, tag: str) -> list[float]:
        """Reward of one response per (prompt, prompt_ids, answer) at `temperature` (0: greedy)."""
        sp = dataclasses.replace(self.sampling, temperature=temperature)
        outs = await asyncio.gather(*[self.engine.generate(GenerateRequest(f"{tag}-{i}", ids, sp))
                                      for i, (_, ids, _) in enumerate(items)])
        return [float(self.reward_fn(prompt, self.decode(o.token_ids), answer))
                for (prompt, _, answer), o in zip(items, outs)]

    def abort_all(self, step) -> int:
        if step not in self.closed_steps:
            self.closed_steps.append(step)
        return self.engine.abort_all()

    def update_weights(self, state_dict, version: int) -> None:
        self.engine.update_weights(state_dict, version)

    def set_kv_reuse(self, enabled: bool) -> None:
        self.engine.set_kv_reuse(enabled)

    def stats(self, drain: bool = True):
        return self.engine.stats(drain)
