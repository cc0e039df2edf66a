"""Multi-turn episodes: a user's async function drives one sample through its turns.

    async def episode(ep: Episode) -> float | None:
        while True:
            text = await ep.generate(stop=("?",))          # a model turn (tokens trained)
            if not text.endswith("?"):
                return None                                 # None: the task's reward scores the response
            value = await ep.call_tool("lookup", lookup, text)   # recorded: never run twice
            ep.append_env(f"={value}")                      # environment tokens (context, not trained)

It is loaded by dotted path (`rollout.episode_fn`). An APRIL abort lands only inside `generate`: the
episode is unwound there (`Interrupted`), and the sample goes to the store with its trajectory (ids,
loss mask, logprobs, versions) and `ep.state`, as JSON. When the sample is resumed, at a later step or
after a restart from a checkpoint, the function is called again with the handle as it was, and its first
`generate` continues the interrupted turn with the remaining budget. So an episode keeps what it needs
across turns in `ep.state` (JSON values), and the code before its first `generate` must be safe to run
again. Tool calls go through `call_tool`: each result is recorded by (sample, turn, call) in the job's
`ToolJournal` the moment it returns, so no call that returned ever runs again, whatever dies later (an
engine mid-call, the driver); a call still running when the step ends finishes first (bounded by
`rollout.tool_timeout_s`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any, Awaitable, Callable

from april_ray.types import FinishReason, GenerateRequest, Sample, SampleState, SamplingParams


class Interrupted(BaseException):
    """The step's abort reached this episode inside `generate` (a BaseException: an episode's own
    `except Exception` must not swallow it)."""


class ToolJournal:
    """Tool results by (sample id, turn, call): the record that makes a returned call final. With a `path`,
    every entry is also appended to that JSONL file (flushed before `put` returns) and read back when the
    journal starts again: the job's journal is an actor (actors/journal.py) that Ray restarts, and a resumed
    job reopens its file."""

    def __init__(self, path: str | Path | None = None):
        self.results: dict[str, Any] = {}
        self.path = Path(path) if path else None
        if self.path is not None and self.path.is_file():
            for i, line in enumerate(self.path.read_text().splitlines(), 1):
                try:
                    key, value = json.loads(line)
                except ValueError:  # a line cut by a crash mid-write: its call never returned to anyone
                    continue
                self.results.setdefault(key, value)

    async def get(self, key: str):
        return self.results.get(key)

    async def put(self, key: str, value) -> None:
        if key in self.results:
            return
        line = json.dumps([key, value])  # a value that is not JSON fails here, before it is recorded
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(line + "\n")
        self.results[key] = value


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
    def turn(self) -> int:
        """Model turns completed."""
        return self.sample.episode["turn"]

    @property
    def prompt(self) -> str:
        return self.sample.prompt

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
        self.sample = self.sample.with_environment(ids)

    async def call_tool(self, name: str, fn: Callable[..., Any | Awaitable[Any]], *args) -> Any:
        """`fn(*args)` (sync or async), once per (sample, turn, call): a result recorded earlier is returned
        without running it. A result must be JSON."""
        index = self._calls.get(self.turn, 0)
        self._calls[self.turn] = index + 1
        key = f"{self.sample.sample_id}/{self.turn}/{index}/{name}"
        recorded = await self._ctx.journal.get(key)
        if recorded is not None:
            return recorded["value"]
        value = fn(*args)
        if asyncio.iscoroutine(value):
            value = await asyncio.wait_for(value, self._ctx.tool_timeout_s)
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
