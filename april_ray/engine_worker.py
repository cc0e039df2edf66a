"""The logic of an EngineWorker actor: samples in, samples out, around any `engine.base.Engine`.

A sample goes in with its prompt ids and the tokens it already has, and is generated with its remaining
budget; it comes back extended (ids, behaviour logprobs, versions) and, if it finished, rewarded. The
reward is computed here, the moment a sample finishes, so no reward call ever sits on the abort path
(DESIGN-NOTES, item 6).

Aborts are race-free through a step gate: `abort_all(step)` closes the step, and a `generate` for a
closed step that arrives later (it was in flight in Ray's queue when the abort ran) returns at once,
untouched, instead of escaping the abort (DESIGN-NOTES, item 5).
"""
from __future__ import annotations

import dataclasses

from april_ray.types import GenerateRequest, Sample, SampleMeta, SampleState, SamplingParams


def sample_meta(sample: Sample, num_new_tokens: int) -> SampleMeta:
    counts: dict[int, int] = {}
    for v in sample.versions:
        counts[v] = counts.get(v, 0) + 1
    return SampleMeta(sample.sample_id, sample.group_id, sample.state, num_new_tokens,
                      len(sample.response_ids), sample.reward, counts)


class EngineWorker:
    def __init__(self, engine, decode, reward_fn, sampling: SamplingParams):
        self.engine = engine
        self.decode = decode
        self.reward_fn = reward_fn
        self.sampling = sampling
        self.closed_step = -1

    async def generate(self, sample: Sample, step: int) -> tuple[SampleMeta, Sample]:
        if step <= self.closed_step:
            return sample_meta(sample, 0), sample
        sample = dataclasses.replace(sample, num_resumes=sample.num_resumes + bool(sample.response_ids))
        sp = dataclasses.replace(self.sampling, max_new_tokens=sample.remaining_budget)
        out = await self.engine.generate(GenerateRequest(f"{sample.sample_id}@{step}", sample.input_ids, sp))
        sample.extend(out)
        if sample.state == SampleState.FINISHED:
            text = self.decode(sample.response_ids)
            sample.reward = float(self.reward_fn(sample.prompt, text, sample.answer))
        return sample_meta(sample, out.num_tokens), sample

    def abort_all(self, step: int) -> int:
        self.closed_step = max(self.closed_step, step)
        return self.engine.abort_all()

    def update_weights(self, state_dict, version: int) -> None:
        self.engine.update_weights(state_dict, version)

    def stats(self, drain: bool = True):
        return self.engine.stats(drain)
