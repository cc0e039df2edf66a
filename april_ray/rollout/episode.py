"""Multi-turn episodes: a user's async function drives one sample through its turns.

    async def episode(ep: Episode) -> float | None:
        while True:
            text = await ep.generate(stop=("?",))          # a model turn (tokens trained)
            if not text.endswith("?"):
                return None                                 # None: the task's reward scores the response
            value = await ep.call_tool("lookup", lookup, text)   # journaled for this trajectory
            ep.append_env(f"={value}")                      # environment tokens (context, not trained)

It is loaded by dotted path (`rollout.episode_fn`; `rollout.episode_kwargs` are passed after the handle).
An APRIL abort lands only inside `generate`: the episode is unwound there (`Interrupted`), and the sample
goes to the store with its trajectory (ids, loss mask, logprobs, versions) and `ep.state`, as JSON. When
the sample is resumed, at a later step or after a restart from a checkpoint, the function is called again
with the handle as it was, and its first `generate` continues the interrupted turn with the remaining
budget. So an episode keeps what it needs across turns in `ep.state` (JSON values), and the code before its
first `generate` must be safe to run again.

Tool calls go through `call_tool`. A call's key is its trajectory's: (sample, turn, call, a hash of every
token id before the call), so a result is handed only to the trajectory that asked for it; one that
restarted (staleness.policy=restart), replayed other tokens after an engine crash, or redid a step after a
resume asks under another key, and the tool runs for it. Each result is recorded in the job's `ToolJournal`
the moment it returns and before the episode sees it, so no call that returned runs again for its
trajectory, whatever dies later; a call still running when the step ends finishes first (bounded by
`rollout.tool_timeout_s`). A tool that takes an `idempotency_key` keyword gets that key: the same on every
replay of the trajectory, so a tool with side effects can recognise a call it has already carried out (one
cut off by a crash before its result was journaled).
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import time
from array import array
from pathlib import Path
from typing import Any, Awaitable, Callable

from april_ray.plugins import in_thread, is_async, takes_keyword
from april_ray.task.rewards import reward_value
from april_ray.types import FinishReason, GenerateRequest, Sample, SampleState, SamplingParams


class Interrupted(BaseException):
    """The step's abort reached this episode inside `generate` (a BaseException: an episode's own
    `except Exception` must not swallow it)."""


class ToolCallsStopped(RuntimeError):
    """The job is ending (its driver is gone): no new tool call starts."""


def tool_key(sample: Sample, turn: int, index: int, name: str) -> str:
    """A tool call's key, bound to its trajectory: `sample/turn/call/hash of the ids before it/name`."""
    digest = hashlib.sha256(array("q", sample.input_ids).tobytes()).hexdigest()[:16]
    return f"{sample.sample_id}/{turn}/{index}/{digest}/{name}"


class ToolJournal:
    """Tool results by key (`tool_key`): the record that makes a returned call final. With a `path`, every
    entry is also appended to that JSONL file (written before `put` returns) and read back when the journal
    starts again: the job's journal is an actor (actors/journal.py) that Ray restarts, and a resumed job
    reopens its file. Entries no trajectory asks for again stay in the file, for inspection; nothing hands
    them to another trajectory. `calls_open`: whether a new call may start (the job's driver still lives)."""

    def __init__(self, path: str | Path | None = None, calls_open: Callable[[], bool] = lambda: True):
        self.results: dict[str, Any] = {}
        self.path = Path(path) if path else None
        self.calls_open = calls_open
        if self.path is not None and self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    key, value = json.loads(line)
                except ValueError:  # a line cut by a crash mid-write: its call never returned to anyone
                    continue
                self.results.setdefault(key, value)

    async def begin(self, key: str):
        """The result recorded under `key`, or None: the caller runs the call (`ToolCallsStopped` once the
        job is ending)."""
        if key in self.results:
            return self.results[key]
        if not self.calls_open():
            raise ToolCallsStopped(f"tool call {key}: the job's driver is gone, no new call starts")
        return None

    async def put(self, key: str, value) -> None:
        if key in self.results:
            return
        line = json.dumps([key, value])  # a value that is not JSON fails here, before it is recorded
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(line + "\n")
        self.results[key] = value


class EvaluationJournal(ToolJournal):
    """An evaluation episode's: in memory, so nothing of an evaluation is kept or reused by another; a new
    call still asks the job's journal first, so none starts once the driver is gone."""

    def __init__(self, job_journal):
        super().__init__()
        self.job_journal = job_journal

    async def begin(self, key: str):
        if key in self.results:
            return self.results[key]
        await self.job_journal.begin(key)  # evaluation's sample ids are never training's: None, or it refuses
        return None


@dataclasses.dataclass
class ToolStats:
    """Tool calls of one engine's episodes since the last drain (`rollout/tool_*`)."""

    calls: int = 0
    """Calls that ran the tool."""
    replays: int = 0
    """Calls answered from the journal (a replayed trajectory)."""
    errors: int = 0
    """Calls that raised or timed out."""
    seconds: float = 0.0
    """Wall seconds of the calls that ran."""

    def drain(self) -> "ToolStats":
        out = dataclasses.replace(self)
        self.calls = self.replays = self.errors = 0
        self.seconds = 0.0
        return out


@dataclasses.dataclass(frozen=True)
class EpisodeContext:
    """What an engine worker lends each episode: its engine, tokenizer, sampling and the step gate."""

    engine: Any
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    sampling: SamplingParams
    max_model_len: int
    journal: Any
    closed_steps: Any
    tool_timeout_s: float
    max_turns: int = 0
    """Model turns per episode at most (0: no limit)."""
    max_env_tokens: int = 0
    """Environment tokens per `append_env` at most (0: no limit)."""
    tool_stats: ToolStats = dataclasses.field(default_factory=ToolStats)


class Episode:
    """The handle an episode function gets: one sample, its turns so far, and the episode's `state`."""

    def __init__(self, ctx: EpisodeContext, sample: Sample, step, tag: str):
        self._ctx, self._step, self._tag = ctx, step, tag
        record = sample.episode or {"turn": 0, "turn_start": 0, "in_turn": False, "state": {}}
        self.sample = dataclasses.replace(sample, episode=record)
        self.state: dict = json.loads(json.dumps(record["state"]))
        """JSON values the episode keeps across turns (and interruptions)."""
        self.num_new_tokens = 0
        """Model tokens generated in this call."""
        self.finish_reason: FinishReason | None = None
        """How the last model turn ended: STOP (a stop id) or LENGTH (the budget or the context ran out)."""
        self._num_calls = 0
        """Engine calls of this invocation (request ids are unique per call)."""
        self._calls: dict[int, int] = {}
        """Tool calls made at each turn by this invocation: with the turn, a call's key in the journal."""

    @property
    def context(self) -> EpisodeContext:
        """What the episode runs in: its engine, tool journal and statistics (the agent endpoint journals an
        agent's own tool calls in it)."""
        return self._ctx

    @property
    def turn(self) -> int:
        """Model turns completed."""
        return self.sample.episode["turn"]

    @property
    def prompt(self) -> str:
        return self.sample.prompt

    def reward_turn(self, value: float) -> None:
        """The reward of the current turn (`turn`: a tool call that succeeded, a format kept). It is kept in
        the episode's record, so it survives interruptions, and added to the sample's reward when the
        episode ends in training, whatever scores the rest (its return, the task's reward, the group
        function); held-out evaluation scores without it. One per turn: a second call in the same turn
        (code run again after a resume) replaces the first."""
        try:
            value = reward_value(value)
        except ValueError as e:
            raise ValueError(f"reward_turn of {self.sample.sample_id}: {e}") from None
        self._record(turn_rewards=self.turn_rewards | {str(self.turn): value})

    @property
    def turn_rewards(self) -> dict[str, float]:
        """Each rewarded turn's reward so far, by turn (as a string: the record is JSON)."""
        return dict(self.sample.episode.get("turn_rewards", {}))

    @property
    def metadata(self) -> dict:
        return self.sample.metadata

    def text(self) -> str:
        """The response so far, model and environment tokens, decoded."""
        return self._ctx.decode(self.sample.response_ids)

    async def generate(self, stop: tuple[str, ...] = ()) -> str:
        """One model turn: generate until EOS, a `stop` string, the budget or the context; returns the turn's
        text. After an interruption, the first call continues the interrupted turn. A stop string of several
        tokens stops the engine at its last token, and the turn goes on unless the text ends with it."""
        if not self.sample.episode["in_turn"]:
            if self._ctx.max_turns and self.turn >= self._ctx.max_turns:
                self.finish_reason = FinishReason.LENGTH
                return ""
            self._record(turn_start=len(self.sample.response_ids), in_turn=True)
        stop_ids = tuple({self._ctx.encode(s)[-1] for s in stop if s})
        while True:
            budget = min(self.sample.remaining_budget, self._ctx.max_model_len - len(self.sample.input_ids))
            if budget <= 0:
                return self._end_turn(FinishReason.LENGTH)
            if self._step in self._ctx.closed_steps:  # aborted while the episode was outside the engine
                raise Interrupted
            out = await self._engine_call(budget, stop_ids)
            if out.finish_reason == FinishReason.ABORT:
                self._record()
                raise Interrupted
            text = self._turn_text()
            eos = out.token_ids[-1:] and out.token_ids[-1] in self._ctx.sampling.stop_token_ids
            if out.finish_reason != FinishReason.STOP or eos or any(text.endswith(s) for s in stop) or not stop:
                return self._end_turn(out.finish_reason)

    async def _engine_call(self, budget: int, stop_ids: tuple[int, ...]):
        sampling = dataclasses.replace(self._ctx.sampling, max_new_tokens=budget,
                                       stop_token_ids=self._ctx.sampling.stop_token_ids + stop_ids)
        self._num_calls += 1
        rid = f"{self.sample.sample_id}#{self.turn}.{self._num_calls}{self._tag}"
        out = await self._ctx.engine.generate(GenerateRequest(rid, self.sample.input_ids, sampling))
        self.num_new_tokens += out.num_tokens
        self.sample = self.sample.extended(out)
        return out

    def _turn_text(self) -> str:
        return self._ctx.decode(self.sample.response_ids[self.sample.episode["turn_start"]:])

    def append_env(self, text_or_ids: str | list[int]) -> None:
        """Environment tokens (a tool's answer, a user turn): in the context, masked out of the loss."""
        ids = self._ctx.encode(text_or_ids) if isinstance(text_or_ids, str) else list(text_or_ids)
        if self._ctx.max_env_tokens:
            ids = ids[:self._ctx.max_env_tokens]
        self.sample = self.sample.with_environment(ids)

    def new_segment(self, prompt_ids: list[int]) -> None:
        """Start the trajectory again from `prompt_ids` (an agent's request that does not extend it, see
        agent_endpoint.py): the tokens so far leave the sample (its model tokens counted as discarded and
        still spent from the budget), so it trains only on what is sampled after this context."""
        s = self.sample
        self.sample = dataclasses.replace(s, prompt_ids=list(prompt_ids), response_ids=[], logprobs=[], versions=[],
                                          loss_mask=[], max_response_len=s.remaining_budget,
                                          num_discarded_tokens=s.num_discarded_tokens + s.num_model_tokens)
        self._record(turn_start=0, in_turn=False)

    async def call_tool(self, name: str, fn: Callable[..., Any | Awaitable[Any]], *args, **kwargs) -> Any:
        """`fn(*args, **kwargs)` once per trajectory and call (`tool_key`): a result recorded earlier for this
        trajectory is returned without running it. An `async def` runs on the loop; a plain function in a
        thread of its own, so the engine's loop never waits on it. Either raises TimeoutError past
        `rollout.tool_timeout_s`. A tool with an `idempotency_key` keyword gets the call's key. A result must
        be JSON; it is journaled before it is returned."""
        index = self._calls.get(self.turn, 0)
        self._calls[self.turn] = index + 1
        key = tool_key(self.sample, self.turn, index, name)
        stats = self._ctx.tool_stats
        recorded = await self._ctx.journal.begin(key)
        if recorded is not None:
            stats.replays += 1
            return recorded["value"]
        if takes_keyword(fn, "idempotency_key"):
            kwargs["idempotency_key"] = key
        t0 = time.perf_counter()
        try:
            value = await run_tool(fn, args, kwargs, self._ctx.tool_timeout_s, name)
        except Exception:
            stats.errors += 1
            raise
        finally:
            stats.calls += 1
            stats.seconds += time.perf_counter() - t0
        await self._ctx.journal.put(key, {"value": value})
        return value

    def finished(self, reward: float | None) -> Sample:
        """The sample as the episode left it: FINISHED, with `reward` (None: the task's reward scores it)."""
        self._record(in_turn=False)
        return dataclasses.replace(self.sample, state=SampleState.FINISHED, reward=reward,
                                   finish_reason=self.sample.finish_reason or FinishReason.STOP)

    def _end_turn(self, reason: FinishReason) -> str:
        record = self.sample.episode
        self.finish_reason = reason
        text = self._turn_text()
        self._record(turn=record["turn"] + 1, in_turn=False)
        return text

    def _record(self, **changes) -> None:
        """The episode's record in the sample, with a copy of `state` (checked to be JSON: it is saved so)."""
        try:
            state = json.loads(json.dumps(self.state))
        except (TypeError, ValueError) as e:
            raise TypeError(f"episode state of {self.sample.sample_id}: not JSON values ({e})") from None
        self.sample = dataclasses.replace(self.sample, episode=self.sample.episode | changes | {"state": state})


def with_turn_rewards(sample: Sample) -> Sample:
    """The sample with its episode's turn rewards added to its reward (once scored)."""
    turns = (sample.episode or {}).get("turn_rewards")
    if not turns or sample.reward is None:
        return sample
    return dataclasses.replace(sample, reward=sample.reward + sum(turns.values()))


async def run_tool(fn, args: tuple, kwargs: dict, timeout_s: float, name: str):
    """`fn`'s value: an async one awaited on the loop, a plain one in a thread, within `timeout_s`."""
    try:
        if is_async(fn):
            return await asyncio.wait_for(fn(*args, **kwargs), timeout_s)
        value = await asyncio.wait_for(in_thread(fn, *args, **kwargs), timeout_s)
        if asyncio.iscoroutine(value):  # a plain function that returned a coroutine
            value = await asyncio.wait_for(value, timeout_s)
        return value
    except asyncio.TimeoutError:
        raise TimeoutError(f"tool {name!r}: no result within rollout.tool_timeout_s={timeout_s:g}s") from None
