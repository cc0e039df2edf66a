"""The logic of an EngineWorker actor: samples in, samples out, around any `engine.base.Engine`.

A sample goes in with its prompt ids and the tokens it already has, and is generated with its remaining
budget; it comes back extended (ids, behaviour logprobs, versions) and, if it finished, rewarded. The
reward is computed here, the moment a sample finishes, so no reward call ever sits on the abort path
(a slow reward would otherwise hold up the end of the step).

Aborts are race-free through a step gate: `abort_all(step)` closes the step, and a `generate` for a
closed step that arrives later (it was in flight in Ray's queue when the abort ran) returns at once,
untouched, instead of escaping the abort (an abort sent once would miss it). A step is any hashable token unique
to one rollout step; the monitor uses (its run id, step number), so a new monitor on the same engines
starts with open steps.
"""
from __future__ import annotations

import asyncio
import dataclasses
from bisect import bisect_right
from collections import deque
from functools import partial

from april_ray.config import EngineConfig, SamplingConfig, StalenessConfig, TaskConfig
from april_ray.engine.probe import saturated_throughput
from april_ray.task.rewards import RewardRunner
from april_ray.types import GenerateRequest, Sample, SampleMeta, SampleState, SamplingParams, with_fields


def version_counts(versions: list[int]) -> dict[int, int]:
    """Tokens per version, oldest first. Most responses hold one version (one C-level count says so), or
    two (the first token's and the last's counts add up to the length); the rest a few runs, as the
    tokens came, each found by a binary search and checked by a count of the whole list (a run whose
    value also occurs elsewhere, as in a list that is not in order, fails the check, and the list is
    counted value by value). Either beats a `Counter` (a sixth of the worker's CPU in a large
    simulation), and the runs beat a set of the list (another tenth)."""
    if not versions:
        return {}
    n, first, last = len(versions), versions[0], versions[-1]
    c = versions.count(first)
    if c == n:
        return {first: n}
    if last != first and c + (d := versions.count(last)) == n:  # two versions (a response resumed once)
        return {first: c, last: d} if first < last else {last: d, first: c}
    counts, i = {}, 0
    while i < n:  # every value is counted in full: the runs cover the list only if each is all of its value
        v = versions[i]
        j = bisect_right(versions, v, i)
        if v in counts or versions.count(v) != j - i:
            return {v: versions.count(v) for v in sorted(set(versions))}
        counts[v] = j - i
        i = j
    return counts if list(counts) == sorted(counts) else dict(sorted(counts.items()))


def sample_meta(sample: Sample, num_new_tokens: int) -> SampleMeta:
    return SampleMeta(sample.sample_id, sample.group_id, sample.state, num_new_tokens,
                      len(sample.response_ids), sample.reward, version_counts(sample.versions))


_BY_BUDGET: dict[tuple[int, int], tuple[SamplingParams, SamplingParams]] = {}


def sampling_for(sampling: SamplingParams, budget: int) -> SamplingParams:
    """`sampling` with `max_new_tokens=budget`, one shared copy per (parameters, budget) in the process
    (requests only read them): made once instead of at every engine call. Fresh samples all ask for the
    whole budget; a large simulation's thousand workers share the parameters, and so the copies. An entry
    holds its parameters, so their id stays theirs while it lives."""
    hit = _BY_BUDGET.get((id(sampling), budget))
    if hit is not None and hit[0] is sampling:
        return hit[1]
    if len(_BY_BUDGET) >= 4096:
        _BY_BUDGET.clear()
    sp = with_fields(sampling, max_new_tokens=budget)
    _BY_BUDGET[(id(sampling), budget)] = (sampling, sp)
    return sp


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
    stale_kv_versions = staleness.max_versions if engine_cfg.reuse_stale_kv else 0
    return EngineWorker(build_engine(engine_cfg, model_path, version, stale_kv_versions),
                        lambda ids: tok.decode(ids, skip_special_tokens=True), get_reward_fn(task.name), sampling,
                        tok.encode, task.reward_timeout_s)


class _GroupCall:
    """One group call: its requests, and its outputs so far. `done` resolves with (metas, samples) when
    the last output has arrived and every reward is in."""

    __slots__ = ("done", "calls", "left", "rewards")

    def __init__(self, done: asyncio.Future, left: int):
        self.done, self.left = done, left
        self.calls: list[tuple[Sample, asyncio.Future]] = []
        """(the sample's copy the output extends, the output), in the order sent."""
        self.rewards: list[tuple[Sample, asyncio.Future]] = []

    def ended(self, done: asyncio.Future) -> None:
        """A call that failed or was cancelled cancels the requests still out (the engine aborts them)."""
        if done.cancelled() or done.exception() is not None:
            self.stop()

    def stop(self) -> None:
        for _, out in self.calls:
            out.cancel()


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
        """Generate some samples of one group at once: (their metas, the samples extended). See `start_group`."""
        return await self.start_group(samples, step)

    def start_group(self, samples: list[Sample], step, done: asyncio.Future | None = None) -> asyncio.Future:
        """`generate_group` as a future (`done`, or a new one), driven by callbacks (no task of its own:
        the in-process pool makes one call per group, a large simulation millions). Each output is taken
        the moment it arrives (the sample is extended and, if finished, its reward starts), and the future
        resolves when the last one has and the rewards are in. It fails with the first output that fails,
        or with what sending a request raised, and is cancelled with the first output (or reward) that is;
        then, or when it is cancelled, the requests still out are cancelled (the engine aborts them), and
        the samples stay as they were sent (the engine extends copies). A `done` that is already done sends
        nothing."""
        if done is None:
            done = asyncio.get_running_loop().create_future()
        elif done.done():
            return done
        if step in self.closed_steps or not samples:
            done.set_result(([sample_meta(s, 0) for s in samples], list(samples)))
            return done
        group = _GroupCall(done, len(samples))
        tag = f"@{step}"
        try:
            for s in samples:
                s = s.resend()
                out = self.engine.generate(GenerateRequest(s.sample_id + tag, s.input_ids,
                                                           sampling_for(self.sampling, s.remaining_budget)))
                if not isinstance(out, asyncio.Future):  # a coroutine (the CPU engine's, SGLang's client)
                    out = asyncio.ensure_future(out)
                group.calls.append((s, out))
                out.add_done_callback(partial(self._arrived, s, group))
        except Exception as e:
            done.set_exception(e)
            group.stop()
            return done
        except BaseException:  # (an interrupt: the requests sent are cancelled, and it goes on up)
            group.stop()
            done.cancel()
            raise
        done.add_done_callback(group.ended)
        return done

    def _arrived(self, sample: Sample, group: "_GroupCall", out: asyncio.Future) -> None:
        done = group.done
        if done.done():
            return
        if out.cancelled():
            done.cancel()
            return
        if out.exception() is not None:
            done.set_exception(out.exception())
            return
        sample.extend(out.result())
        if sample.state == SampleState.FINISHED:
            reward = self.reward(sample.prompt, self.decode(sample.response_ids), sample.answer)
            if not isinstance(reward, asyncio.Future):  # a coroutine (`RewardRunner`'s)
                reward = asyncio.ensure_future(reward)
            group.rewards.append((sample, reward))
        group.left -= 1
        if not group.left:
            self._rewarded(group)

    def _rewarded(self, group: "_GroupCall", _=None) -> None:
        """Every output is in: resolve the call once its rewards are (waiting on the first still running)."""
        if group.done.done():
            return
        for _, r in group.rewards:
            if not r.done():
                r.add_done_callback(partial(self._rewarded, group))
                return
        for s, r in group.rewards:
            if r.cancelled():
                group.done.cancel()
                return
            if r.exception() is not None:
                group.done.set_exception(r.exception())
                return
            s.reward = r.result()
        calls = group.calls
        group.done.set_result(([sample_meta(s, out.result().num_tokens) for s, out in calls], [s for s, _ in calls]))

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
