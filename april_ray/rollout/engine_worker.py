"""The logic of an EngineWorker actor: samples in, samples out, around any `engine.base.Engine`.

A sample goes in with its prompt ids and the tokens it already has, and is generated with its remaining
budget; it comes back extended (ids, behaviour logprobs, versions) and, if it finished, rewarded. The
reward is computed here, the moment a sample finishes, so no reward call ever sits on the abort path
(a slow reward would otherwise hold up the end of the step).

Aborts are race-free through a step gate: `abort_all(step)` closes the step, and a `generate_group` for
a closed step that arrives later (it was in flight in Ray's queue when the abort ran) returns at once,
untouched, instead of escaping the abort (an abort sent once would miss it). A step is any hashable token
unique to one rollout step; the monitor uses (its run id, step number), so a new monitor on the same
engines starts with open steps.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter, deque

from april_ray.config import EngineConfig, SamplingConfig, StalenessConfig, TaskConfig
from april_ray.engine.probe import saturated_throughput
from april_ray.task.rewards import RewardRunner
from april_ray.types import GenerateRequest, Sample, SampleMeta, SampleState, SamplingParams


def sample_meta(sample: Sample, num_new_tokens: int) -> SampleMeta:
    counts = dict(sorted(Counter(sample.model_versions).items()))
    model = sample.num_model_tokens
    return SampleMeta(sample.sample_id, sample.group_id, sample.state, num_new_tokens, model, sample.reward, counts,
                      len(sample.response_ids) - model)


def build_worker(engine_cfg: EngineConfig, sampling_cfg: SamplingConfig, staleness: StalenessConfig, task: TaskConfig,
                 model_path: str, version: int = 0) -> "EngineWorker":
    """An EngineWorker on the configured engine backend, with the task's reward (under its timeout) and the
    configured sampling."""
    from transformers import AutoTokenizer

    from april_ray.engine import build_engine
    from april_ray.task.rewards import get_reward_fn

    tok = AutoTokenizer.from_pretrained(model_path)
    sampling = SamplingParams(sampling_cfg.temperature, sampling_cfg.top_p, sampling_cfg.top_k,
                              sampling_cfg.max_response_len, (tok.eos_token_id,))
    kv_max_versions = staleness.max_versions if engine_cfg.reuse_stale_kv else 0
    return EngineWorker(build_engine(engine_cfg, model_path, version, max_versions=kv_max_versions),
                        lambda ids: tok.decode(ids, skip_special_tokens=True), get_reward_fn(task.name), sampling,
                        tok.encode, task.reward_timeout_s)


async def gather_or_cancel(*aws):
    """`asyncio.gather`, but the first failure cancels the rest (the engine aborts their requests)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


class EngineWorker:
    def __init__(self, engine, decode, reward_fn, sampling: SamplingParams, encode=None,
                 reward_timeout_s: float = TaskConfig.reward_timeout_s):
        self.engine = engine
        self.decode = decode
        self.encode = encode
        """The tokenizer's encode, for callers that build evaluation items in this process."""
        self.reward = RewardRunner(reward_fn, reward_timeout_s)
        """Off the event loop with a timeout; a call that fails scores 0 and is counted (`stats`)."""
        self.sampling = sampling
        self.closed_steps: deque = deque(maxlen=64)

    async def generate_group(self, samples: list[Sample], step) -> tuple[list[SampleMeta], list[Sample]]:
        """Generate some samples of one group at once: (their metas, the samples extended and rewarded).
        The first sample that fails (or is cancelled) fails the call and cancels the rest; the samples sent
        are never changed, so a failed call leaves them as they were."""
        if step in self.closed_steps or not samples:
            return [sample_meta(s, 0) for s in samples], list(samples)
        done = await gather_or_cancel(*(self.generate_sample(s, f"@{step}") for s in samples))
        return [m for m, _ in done], [s for _, s in done]

    async def generate_sample(self, sample: Sample, tag: str) -> tuple[SampleMeta, Sample]:
        """One engine call with the sample's remaining budget, then its reward if it finished."""
        sample = sample.resend()
        sampling = dataclasses.replace(self.sampling, max_new_tokens=sample.remaining_budget)
        out = await self.engine.generate(GenerateRequest(sample.sample_id + tag, sample.input_ids, sampling))
        sample = sample.extended(out)
        if sample.state == SampleState.FINISHED:
            reward = await self.reward(sample.prompt, self.decode(sample.response_ids), sample.answer)
            sample = dataclasses.replace(sample, reward=reward)
        return sample_meta(sample, out.num_tokens), sample

    async def throughput_probe(self, prompts: list[list[int]], concurrency: int, seconds: float,
                               warmup_s: float = 1.0) -> tuple[int, float, float]:
        """Saturated throughput on this workload, inside the engine's process (`engine.probe`): (tokens,
        seconds, the process's CPU seconds meanwhile)."""
        tokens, dt, _, cpu = await saturated_throughput(self.engine, prompts, self.sampling, concurrency, seconds,
                                                        warmup_s)
        return tokens, dt, cpu

    async def evaluate(self, items: list[tuple[str, list[int], str]], temperature: float, tag: str) -> list[float]:
        """Reward of one response per (prompt, prompt_ids, answer) at `temperature` (0: greedy)."""
        sp = dataclasses.replace(self.sampling, temperature=temperature)
        outs = await asyncio.gather(*[self.engine.generate(GenerateRequest(f"{tag}-{i}", ids, sp))
                                      for i, (_, ids, _) in enumerate(items)])
        return list(await asyncio.gather(*[self.reward(prompt, self.decode(o.token_ids), answer)
                                           for (prompt, _, answer), o in zip(items, outs)]))

    def abort_all(self, step) -> int:
        if step not in self.closed_steps:
            self.closed_steps.append(step)
        return self.engine.abort_all()

    def update_weights(self, state_dict, version: int) -> None:
        self.engine.update_weights(state_dict, version)

    def stats(self, drain: bool = True):
        """The engine's statistics, with the reward errors since the last drain."""
        errors = self.reward.drain_errors() if drain else self.reward.errors
        return dataclasses.replace(self.engine.stats(drain), reward_errors=errors)
