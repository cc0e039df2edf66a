"""The logic of an EngineWorker actor: samples in, samples out, around any `engine.base.Engine`.

A sample goes in with its prompt ids and the tokens it already has, and is generated with its remaining
budget; it comes back extended (ids, behaviour logprobs, versions) and, if it finished, rewarded. The
reward is computed here, the moment a sample finishes, so no reward call ever sits on the abort path
(a slow reward would otherwise hold up the end of the step).

Aborts are race-free through a step gate: `abort_all(step)` closes the step, and a `generate_group` for
a closed step that arrives later (it was in flight in Ray's queue when the abort ran) returns at once,
untouched, instead of escaping the abort (an abort sent once would miss it). A step is any hashable token
unique to one rollout step; the monitor uses (its run id, step number), so a new monitor on the same
engines starts with open steps. An abort reaches only its own step's requests: each of them has an id
ending with the step's tag (`step_tag`), and the engine aborts by that tag, so an evaluation sharing the
engine (the overlapped mode) or another step's calls run on untouched.

With `rollout.episode_fn` each sample is an episode of several turns (april_ray/rollout/episode.py): the
worker runs the episode function instead of one engine call, and an abort that lands inside one of its
turns leaves the sample PARTIAL with its trajectory and the episode's state. With `rollout.agent_fn` the
episode is an OpenAI-speaking agent served by this worker's endpoint (april_ray/rollout/agent_endpoint.py).

With `task.reward_per_group` the reward is a group function, so a sample that finishes waits, unrewarded
(reward None, in the store too), until its group is complete. Every call carries all of a group's
unfinished samples (the monitor sends one call per group at a time), so the call in which they all finish
is the one that completes the group, whichever step and engine it runs in. The monitor sends each call the
group's finished samples besides, as read-only `context` (handles: on Ray they come from the object store,
never through the monitor); when every sample sent finishes, the worker calls the group function once on
the whole group and returns the context too, rewarded, so the monitor swaps its handles and metas of those
samples for the rewarded ones before the group meets the dynamic filter. A call that is aborted, refused by
a closed step, or lost with its engine returns no context: the group stays unrewarded and the call that
later completes it scores it from scratch (on a lost call the function may run again; its first values
never reach anyone). Episodes run first and the group function scores their final responses: an episode
that returns a number keeps it (one that raises: its group is dropped), as without the flag, and the group
function scores those that return None, seeing the whole group either way.

An episode that raises is not scored: its sample comes back FINISHED with the error in its episode record
(`SampleMeta.error`), and the monitor drops its group from training (april_ray/rollout/monitor.py), so a
bug in an environment never teaches the policy.
"""
from __future__ import annotations

import asyncio
import dataclasses
import traceback
from collections import deque

from april_ray.config import EngineConfig, RolloutConfig, SamplingConfig, StalenessConfig, TaskConfig
from april_ray.engine.base import EngineLeft
from april_ray.engine.probe import saturated_throughput
from april_ray.plugins import load_object
from april_ray.rollout.agent_endpoint import AgentEndpoint, AgentStats
from april_ray.rollout.episode import (Episode, EpisodeContext, EvaluationJournal, Interrupted, ToolJournal,
                                      ToolStats, with_turn_rewards)
from april_ray.task.evaluate import EvalItem
from april_ray.task.rewards import RewardRunner, reward_value
from april_ray.types import FinishReason, GenerateRequest, Sample, SampleMeta, SampleState, SamplingParams


def build_worker(engine_cfg: EngineConfig, sampling_cfg: SamplingConfig, staleness: StalenessConfig, task: TaskConfig,
                 model_path: str, version: int = 0, *, episodes: RolloutConfig | None = None,
                 journal=None, weights_root: str = "") -> "EngineWorker":
    """An EngineWorker on the configured engine backend, with the task's reward (under its timeout) and the
    configured sampling; with `episodes.episode_fn`, running that episode function, its tool results
    recorded in `journal` (in process when None); with `episodes.agent_fn`, that agent as each sample's
    episode, served by an OpenAI-compatible endpoint of this worker (`AgentEndpoint`)."""
    from april_ray.engine import build_engine
    from april_ray.task.rewards import build_reward_fn, reward_key
    from april_ray.task.tokenizer import load_tokenizer

    tok = load_tokenizer(model_path)  # a worker of HTTP engines then imports neither torch nor a model
    sampling = SamplingParams(sampling_cfg.temperature, sampling_cfg.top_p, sampling_cfg.top_k,
                              sampling_cfg.max_response_len, (tok.eos_token_id,))
    kv_max_versions = staleness.kv_max_versions(engine_cfg.reuse_stale_kv)
    worker = EngineWorker(build_engine(engine_cfg, model_path, version, max_versions=kv_max_versions,
                                       weights_root=weights_root),
                          lambda ids: tok.decode(ids, skip_special_tokens=True), build_reward_fn(task), sampling,
                          tok.encode, task.reward_timeout_s, reward_per_group=task.reward_per_group,
                          reward_key=reward_key(task))
    if episodes is not None and episodes.episode_fn:
        worker.use_episodes(load_object(episodes.episode_fn, "rollout.episode_fn"), journal or ToolJournal(),
                            engine_cfg.max_model_len, episodes.tool_timeout_s,
                            encode=lambda text: tok.encode(text, add_special_tokens=False),
                            kwargs=dict(episodes.episode_kwargs), max_turns=episodes.max_turns,
                            max_env_tokens=episodes.max_env_tokens_per_turn)
    elif episodes is not None and episodes.agent_fn:
        agents = AgentEndpoint(load_object(episodes.agent_fn, "rollout.agent_fn"), tok, engine_cfg.max_model_len,
                               dict(episodes.agent_kwargs), episodes.agent_park_s)
        worker.use_episodes(agents, journal or ToolJournal(), engine_cfg.max_model_len, episodes.tool_timeout_s,
                            encode=lambda text: tok.encode(text, add_special_tokens=False),
                            max_turns=episodes.max_turns, max_env_tokens=episodes.max_env_tokens_per_turn)
    return worker


def step_tag(step) -> str:
    """The end of every request id of `step` on the engine. No step's name holds '@', so no tag ends
    another's, and no evaluation request (`evaluate`: '<tag>-<i>') ends with one."""
    name = str(step)
    assert "@" not in name, f"step token {name!r} must not contain '@'"
    return f"@{name}"


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
                 reward_timeout_s: float = TaskConfig.reward_timeout_s, reward_per_group: bool = False,
                 reward_key: str = "reward"):
        self.engine = engine
        self.decode = decode
        self.encode = encode
        """The tokenizer's encode, for callers that build evaluation items in this process."""
        self.reward = RewardRunner(reward_fn, reward_timeout_s, key=reward_key)
        """Off the event loop with a timeout; a call that fails scores 0 and is counted (`stats`)."""
        self.reward_per_group = reward_per_group
        """`reward_fn` scores whole groups, once each is complete (`reward_group`)."""
        self.sampling = sampling
        self.closed_steps: deque = deque(maxlen=64)
        self.episode_fn = None
        """`rollout.episode_fn`, loaded: each sample is an episode of turns (`use_episodes`)."""
        self.leaving = False
        """Set by `leave`: every call from then on is refused with `EngineLeft`."""
        self.num_calls = 0
        """`generate_group` calls running: what `leave` waits to see return."""

    def use_episodes(self, episode_fn, journal, max_model_len: int, tool_timeout_s: float, encode=None,
                     kwargs: dict | None = None, max_turns: int = 0, max_env_tokens: int = 0) -> None:
        """Run `episode_fn(handle, **kwargs)` per sample; `encode` turns environment text into ids (no special
        tokens)."""
        self.episode_fn = episode_fn
        self.episode_kwargs = kwargs or {}
        self.episodes = EpisodeContext(self.engine, encode or self.encode, self.decode, self.sampling, max_model_len,
                                       journal, self.closed_steps, tool_timeout_s, max_turns, max_env_tokens)

    async def run_episode(self, sample: Sample, step, tag: str, ctx: EpisodeContext | None = None,
                          turn_rewards: bool = True) -> tuple[SampleMeta, Sample]:
        """The sample's episode, from where it stands to its end (rewarded) or to the step's abort (PARTIAL).
        An episode that raises is finished unscored, its error (the traceback) in its episode record; one
        that returns something other than None or a real number scores 0, counted with the reward errors
        (as a reward function's would)."""
        ep = Episode(ctx or self.episodes, sample.resend(), step, tag)
        try:
            reward = await self.episode_fn(ep, **self.episode_kwargs)
        except Interrupted:
            partial = dataclasses.replace(ep.sample, state=SampleState.PARTIAL, finish_reason=FinishReason.ABORT)
            return SampleMeta.of(partial, ep.num_new_tokens), partial
        except Exception:
            ep.state = ep.sample.episode["state"]  # as last recorded: what it holds now may be what failed
            failed = ep.finished(0.0)
            failed = dataclasses.replace(failed, episode=failed.episode | {"error": traceback.format_exc()})
            return SampleMeta.of(failed, ep.num_new_tokens), failed
        why = None
        if reward is not None:
            try:
                reward = reward_value(reward)
            except ValueError as e:
                why = f"rollout.episode_fn {e}"
                reward = self.reward.failed(sample.prompt, why)
        done = ep.finished(reward)
        if done.reward is None and not self.reward_per_group:  # else its group's function scores it
            reward, why = await self.reward.score(done.prompt, self.decode(done.response_ids), done.answer,
                                                  done.metadata)
            done = dataclasses.replace(done, reward=reward)
        done = with_turn_rewards(done) if turn_rewards else done  # training's shaping, not evaluation's score
        return dataclasses.replace(SampleMeta.of(done, ep.num_new_tokens), reward_error=why), done

    async def generate_group(self, samples: list[Sample], step, context: list[Sample] = ()
                             ) -> tuple[list[SampleMeta], list[Sample]]:
        """Generate some samples of one group at once: (their metas, the samples extended and rewarded).
        The first sample that fails (or is cancelled) fails the call and cancels the rest; the samples sent
        are never changed, so a failed call leaves them as they were.

        `context`: the group's finished samples, with `task.reward_per_group`. When every sample sent
        finishes, the group is complete: it is scored, and the result is the samples sent, then the context
        samples, rewarded; otherwise the samples sent alone. A leaving engine refuses (`EngineLeft`)."""
        self.check_staying()
        if step in self.closed_steps or not samples:
            return [SampleMeta.of(s, 0) for s in samples], list(samples)
        run = self.run_episode if self.episode_fn is not None else self.generate_sample
        self.num_calls += 1
        try:
            done = await gather_or_cancel(*(run(s, step, step_tag(step)) for s in samples))
        finally:
            self.num_calls -= 1
        metas, samples = [m for m, _ in done], [s for _, s in done]
        if self.reward_per_group and all(s.state == SampleState.FINISHED for s in samples):
            unscored = [s.reward is None for s in [*samples, *context]]  # what the group function scores
            group, why = await self.reward_group([*samples, *context])
            group = [with_turn_rewards(s) if new else s for s, new in zip(group, unscored)]
            metas += [SampleMeta.of(s, 0) for s in group[len(samples):]]
            return [dataclasses.replace(m, reward=s.reward, reward_error=why if new else m.reward_error)
                    for m, s, new in zip(metas, group, unscored)], group
        return metas, samples

    async def reward_group(self, group: list[Sample]) -> tuple[list[Sample], str | None]:
        """A complete group with the group function's rewards, from one call that sees every sample (and why
        that call failed, or None); a sample that has a reward already (its episode returned one) keeps it."""
        if all(s.reward is not None for s in group):
            return group, None
        rewards, why = await self.reward.score_group([s.prompt for s in group],
                                                     [self.decode(s.response_ids) for s in group],
                                                     [s.answer for s in group], [s.metadata for s in group])
        return [s if s.reward is not None else dataclasses.replace(s, reward=r) for s, r in zip(group, rewards)], why

    async def score(self, prompt: str, response: str, answer: str, metadata: dict) -> float:
        """One response's reward outside a group (evaluation): with `task.reward_per_group`, a group of one."""
        if self.reward_per_group:
            [reward] = await self.reward.group([prompt], [response], [answer], [metadata])
            return reward
        return await self.reward(prompt, response, answer, metadata)

    async def generate_sample(self, sample: Sample, step, tag: str) -> tuple[SampleMeta, Sample]:
        """One engine call with the sample's remaining budget, then its reward if it finished (unless its
        group is scored as a whole)."""
        sample = sample.resend()
        sampling = dataclasses.replace(self.sampling, max_new_tokens=sample.remaining_budget)
        out = await self.engine.generate(GenerateRequest(sample.sample_id + tag, sample.input_ids, sampling))
        sample = sample.extended(out)
        why = None
        if sample.state == SampleState.FINISHED and not self.reward_per_group:
            reward, why = await self.reward.score(sample.prompt, self.decode(sample.response_ids), sample.answer,
                                                  sample.metadata)
            sample = dataclasses.replace(sample, reward=reward)
        return dataclasses.replace(SampleMeta.of(sample, out.num_tokens), reward_error=why), sample

    async def throughput_probe(self, prompts: list[list[int]], concurrency: int, seconds: float,
                               warmup_s: float = 1.0) -> tuple[int, float, float]:
        """Saturated throughput on this workload, inside the engine's process (`engine.probe`): (tokens,
        seconds, the process's CPU seconds meanwhile)."""
        tokens, dt, _, cpu = await saturated_throughput(self.engine, prompts, self.sampling, concurrency, seconds,
                                                        warmup_s)
        return tokens, dt, cpu

    async def evaluate(self, items: list[EvalItem], temperature: float, tag: str,
                       top_p: float | None = None) -> list[tuple[float, int]]:
        """(reward, response length) of one response per item at `temperature` (0: greedy) and `top_p`
        (None: sampling.top_p). Never aborted by a step's interrupt: no request id here ends with a step's tag."""
        assert "@" not in tag, f"evaluation tag {tag!r} must not contain '@' (`step_tag`)"
        sp = dataclasses.replace(self.sampling, temperature=temperature,
                                 top_p=self.sampling.top_p if top_p is None else top_p)
        if self.episode_fn is not None:
            return list(await asyncio.gather(*[self.evaluate_episode(item, sp, f"{tag}-{i}")
                                               for i, item in enumerate(items)]))
        outs = await asyncio.gather(*[self.engine.generate(GenerateRequest(f"{tag}-{i}", ids, sp))
                                      for i, (_, ids, _, _) in enumerate(items)])
        rewards = await asyncio.gather(*[self.score(prompt, self.decode(o.token_ids), answer, metadata)
                                         for (prompt, _, answer, metadata), o in zip(items, outs)])
        return [(r, o.num_tokens) for r, o in zip(rewards, outs)]

    async def evaluate_episode(self, item: EvalItem, sampling: SamplingParams, rid: str) -> tuple[float, int]:
        """One evaluation episode: its own journal (nothing of it is kept; no call starts once the driver is
        gone), never aborted."""
        prompt, ids, answer, metadata = item
        ctx = dataclasses.replace(self.episodes, sampling=sampling, journal=EvaluationJournal(self.episodes.journal),
                                  closed_steps=())
        sample = Sample(rid, rid, prompt, answer, ids, sampling.max_new_tokens, metadata=metadata)
        meta, done = await self.run_episode(sample, None, "", ctx, turn_rewards=False)
        if meta.error:  # held-out accuracy counts it as a wrong answer; the error is logged
            self.reward.failed(prompt, f"evaluation episode raised: {meta.error.strip().splitlines()[-1]}")
        if done.reward is None:
            done = dataclasses.replace(done, reward=await self.score(prompt, self.decode(done.response_ids),
                                                                      answer, metadata))
        return done.reward, done.num_model_tokens

    def abort_all(self, step) -> int:
        """Close `step` and abort its requests on the engine (never an evaluation's or another step's);
        returns how many were aborted."""
        if step not in self.closed_steps:
            self.closed_steps.append(step)
        return self.engine.abort_tagged(step_tag(step))

    def abort_engine(self) -> int:
        """Abort every request on the engine, evaluations' included, closing no step (as an engine's own
        pause in abort mode would): each call returns its partial samples, and the monitor sends them again."""
        return self.engine.abort_all()

    def check_staying(self) -> None:
        if self.leaving:
            raise EngineLeft("the engine is leaving (its node is preempted or drained) and takes no more work")

    async def leave(self, poll_s: float = 0.05) -> int:
        """Leave gracefully (a preemption notice): refuse new calls, and abort every request until no call
        runs, so each running call returns its samples PARTIAL with every token, logprob and version
        generated so far (the monitor resumes them on other engines, or stores them). Re-aborting catches a
        call that submitted its requests just after an abort (it was still fetching its samples). Returns
        the requests aborted."""
        self.leaving = True
        aborted = self.engine.abort_all()
        while self.num_calls:
            await asyncio.sleep(poll_s)
            aborted += self.engine.abort_all()
        return aborted

    def update_weights(self, state_dict, version: int) -> None:
        self.engine.update_weights(state_dict, version)

    def tool_stats(self, drain: bool = True):
        """The episodes' tool calls since the last drain (`ToolStats`), None without episodes."""
        if self.episode_fn is None:
            return None
        return self.episodes.tool_stats.drain() if drain else dataclasses.replace(self.episodes.tool_stats)

    def stats(self, drain: bool = True):
        """The engine's statistics, with the reward errors since the last drain."""
        errors = self.reward.drain_errors() if drain else self.reward.errors
        tools = self.tool_stats(drain) or ToolStats()
        agents = self.agent_stats(drain)
        return dataclasses.replace(self.engine.stats(drain), reward_errors=errors, tool_calls=tools.calls,
                                   tool_errors=tools.errors, tool_s=tools.seconds, tool_replays=tools.replays,
                                   agent_requests=agents.requests, agent_resumed=agents.resumed,
                                   agent_mismatch=agents.mismatch, agent_errors=agents.errors)

    def agent_stats(self, drain: bool = True) -> AgentStats:
        """The agents' requests since the last drain (`AgentStats`; zeros without `rollout.agent_fn`)."""
        if not isinstance(self.episode_fn, AgentEndpoint):
            return AgentStats()
        return self.episode_fn.stats.drain() if drain else dataclasses.replace(self.episode_fn.stats)
