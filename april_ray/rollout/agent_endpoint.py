"""Any agent, unchanged: `rollout.agent_fn` runs against an OpenAI-compatible endpoint, one key per episode.

    async def agent(base_url: str, api_key: str, row: dict, **agent_kwargs) -> float | None

The agent is the sample's episode (april_ray/rollout/episode.py): the engine worker calls
`AgentEndpoint.__call__` with the sample's `Episode` handle, which starts the agent with the URL of a small
aiohttp server of this worker (loopback, a random port, started once) and a key of its own (a random
token that maps to this episode alone: a request under any other key gets 401). The agent speaks
`POST /v1/chat/completions` (`GET /v1/models` names the one model, `agent_chat.MODEL`).

Token-in, token-out underneath. A request's messages (and `tools`) are rendered with the model's chat
template and matched, token by token, against the trajectory the episode holds (`match`):
- it extends the trajectory: its new tail (tool results, user turns, the template's framing) is appended
  as environment tokens (loss mask 0), and the model's turn is generated through the handle;
- it is a prefix followed by model tokens (an agent replayed from its start: after a staleness restart
  of other samples, a driver restart, or a resume on another engine): the recorded turn is answered again,
  its exact tokens, and an interrupted turn goes on;
- anything else (the agent edited, truncated or re-rendered history differently) starts a new segment: the
  trajectory becomes the rendered request (`Episode.new_segment`, counted as `rollout/agent_mismatch`), so
  the sample trains only on tokens the engine sampled in the context it sampled them.
Earlier assistant turns thus keep the exact sampled tokens; text is never re-tokenised into the trajectory.
One exception to exact matching: a turn the model ended at a stop string has no end-of-turn token, which
the template renders after it; that token is left out, as the handle-based episode leaves it out.

An APRIL abort lands inside the handle's `generate`: the request stays open, the episode returns PARTIAL
with its trajectory (the agent keeps running, parked), and when the sample is resumed in this process the
same request goes on with the new handle (`rollout/agent_resumed`) and the agent sees a slower answer. A
sample resumed elsewhere, or not within `rollout.agent_park_s`, runs its agent again from the start (the
parked one is cancelled), served by the replay above. Sampling is the job's (`temperature` and the like in a
request are ignored; `stop` is honoured); `logprobs: true` returns the behaviour logprobs.

Side effects of a replayed agent: each response carries `X-April-Idempotency-Key`, the key of the
trajectory up to that turn (`episode.tool_key`): the same on every replay of the same tokens, so an agent
can recognise a tool call it already carried out; it may keep the call's result in the job's tool journal under
that key (`POST /v1/april/journal`), and a replay reads it back instead of running the tool again: a turn that
calls tools brings the journal's answer along (`april_journal`: `{"key", "value"}` when recorded, `{"key"}` when
not), so running a call costs one request (its record), not two. A malformed
request gets OpenAI's error shape with a 4xx (`agent_chat.RequestError`); the agent's client raises, and its
episode fails and is dropped, not trained.
"""
from __future__ import annotations

import asyncio
import dataclasses
import secrets
from typing import Callable

from aiohttp import web

from april_ray.rollout.agent_chat import (MAX_BODY, MODEL, ChatRequest, RequestError, completion, for_template,
                                          parse_journal, parse_request, tool_call_parser)
from april_ray.rollout.episode import Episode, Interrupted, ToolCallsStopped, tool_key
from april_ray.types import FinishReason

IDEMPOTENCY_HEADER = "X-April-Idempotency-Key"
JOURNAL_PATH = "/v1/april/journal"
JOURNAL_FIELD = "april_journal"
"""A response's field, on a turn that calls tools: the journal's answer for its key (`_recorded`)."""
BACKLOG = 2048
"""Connections the endpoint's socket queues before the event loop accepts them (Linux caps it at somaxconn)."""


@dataclasses.dataclass
class AgentStats:
    """An engine's agent requests since the last drain (`rollout/agent_*`)."""

    requests: int = 0
    resumed: int = 0
    """Requests cut by an abort, kept open and resumed."""
    mismatch: int = 0
    """Requests that did not extend the trajectory: a new segment."""
    errors: int = 0
    """Requests refused with a 4xx."""

    def drain(self) -> "AgentStats":
        out = dataclasses.replace(self)
        self.requests = self.resumed = self.mismatch = self.errors = 0
        return out


def match(ids: list[int], traj: list[int], model: list[int], eos: int,
          decode: Callable[[list[int]], str]) -> tuple[int, int]:
    """How far the rendered `ids` and the trajectory `traj` agree: (ids matched, trajectory matched). `model`
    marks the trajectory's model tokens. A run of model tokens matches the rendered tokens that spell the
    same text (`decode`), so a turn sampled as other tokens than its text's tokenisation still matches and
    stays as sampled; an `eos` in `ids` after a model token that is not one (a turn ended at a stop string)
    matches nothing and is passed over."""
    i = j = 0
    while i < len(ids):
        if j < len(traj) and ids[i] == traj[j]:
            i, j = i + 1, j + 1
        elif ids[i] == eos and j and model[j - 1] and traj[j - 1] != eos:
            i += 1
        elif j < len(traj) and model[j]:
            start = j
            while start and model[start - 1]:
                start -= 1
            end = next((k for k in range(j, len(traj)) if not model[k]), len(traj))
            spelt = _spelling(ids, i - (j - start), decode(traj[start:end]), decode)
            if spelt is None:
                break
            i, j = spelt, end
        else:
            break
    return i, j


def _spelling(ids: list[int], i: int, text: str, decode) -> int | None:
    """The end k of the shortest `ids[i:k]` that decodes to `text`, if any."""
    for k in range(i + 1, len(ids) + 1):
        got = decode(ids[i:k])
        if got == text:
            return k
        if not text.startswith(got[:-1]):  # its last character may be half of a multi-byte one
            return None
    return None


class AgentSession:
    """One episode's agent: its key, its task, the handle it is served through, and the open request that an
    abort parked (`parked`, settled with the next handle when the sample is resumed here)."""

    def __init__(self, key: str, ep: Episode):
        self.key, self.ep = key, ep
        self.task: asyncio.Task | None = None
        self.cut = asyncio.get_running_loop().create_future()
        """Settled when an abort parks the open request: the episode returns PARTIAL."""
        self.parked: asyncio.Future | None = None
        self.lock = asyncio.Lock()
        """One request at a time: they extend one trajectory."""

    def resumes(self, ep: Episode) -> bool:
        """Whether `ep` is this session's sample as it was parked (not restarted, not replayed elsewhere)."""
        return (self.parked is not None and not self.parked.done()
                and ep.sample.input_ids == self.ep.sample.input_ids)

    def attach(self, ep: Episode) -> None:
        self.ep, self.cut = ep, asyncio.get_running_loop().create_future()
        self.parked.set_result(ep)


class AgentEndpoint:
    """The episode function of `rollout.agent_fn`, and the endpoint its agents call (see the module)."""

    def __init__(self, agent_fn, tokenizer, max_model_len: int, agent_kwargs: dict | None = None,
                 park_s: float = 600.0, host: str = "127.0.0.1"):
        self.agent_fn, self.agent_kwargs = agent_fn, dict(agent_kwargs or {})
        self.max_model_len = max_model_len
        self.tokenizer, self.park_s, self.host = tokenizer, park_s, host
        self.parse_tools = tool_call_parser(tokenizer)
        self.eos = tokenizer.eos_token_id
        self.sessions: dict[str, AgentSession] = {}
        """By key."""
        self.by_sample: dict[str, AgentSession] = {}
        self.stats = AgentStats()
        self.base_url: str | None = None
        self._runner: web.AppRunner | None = None
        self._starting: asyncio.Lock | None = None

    async def start(self) -> str:
        """The server's base URL (`http://host:port/v1`), started on the first call."""
        self._starting = self._starting or asyncio.Lock()
        async with self._starting:
            if self.base_url is None:
                app = web.Application(client_max_size=MAX_BODY)
                app.router.add_post("/v1/chat/completions", self._chat)
                app.router.add_get("/v1/models", self._models)
                app.router.add_post(JOURNAL_PATH, self._journal)
                # a parked request is cancelled with its agent, so closing waits for no one
                self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
                await self._runner.setup()
                # a backlog for an evaluation's hundreds of agents connecting at once while the loop decodes
                # (aiohttp's 128 left connects waiting past a client's connect timeout, 5 s for openai's)
                await web.TCPSite(self._runner, self.host, 0, backlog=BACKLOG).start()
                self.base_url = f"http://{self.host}:{self._runner.addresses[0][1]}/v1"
        return self.base_url

    async def close(self) -> None:
        for session in list(self.sessions.values()):
            self._drop(session)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner, self.base_url = None, None

    async def __call__(self, ep: Episode):
        """Run the sample's agent to its end (its return: a reward or None), or until an abort parks its open
        request (`Interrupted`: the sample goes back PARTIAL, the agent waits)."""
        base_url = await self.start()
        session = self.by_sample.get(ep.sample.sample_id)
        if session is not None and session.resumes(ep):
            session.attach(ep)
        else:
            if session is not None:
                self._drop(session)
            session = self._open(ep, base_url)
        try:
            await asyncio.wait([session.task, session.cut], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self._drop(session)
            raise
        if not session.task.done():
            raise Interrupted
        self._drop(session)
        return session.task.result()

    def _open(self, ep: Episode, base_url: str) -> AgentSession:
        session = AgentSession(secrets.token_urlsafe(24), ep)
        row = {"prompt": ep.sample.prompt, "sample_id": ep.sample.sample_id, "metadata": dict(ep.sample.metadata)}
        session.task = asyncio.ensure_future(self.agent_fn(base_url, session.key, row, **self.agent_kwargs))
        self.sessions[session.key] = session
        self.by_sample[ep.sample.sample_id] = session
        return session

    def _drop(self, session: AgentSession) -> None:
        self.sessions.pop(session.key, None)
        if self.by_sample.get(session.ep.sample.sample_id) is session:
            del self.by_sample[session.ep.sample.sample_id]
        if session.task is not None and not session.task.done():
            session.task.cancel()
        if session.parked is not None and not session.parked.done():
            session.parked.cancel()  # its open request ends with the agent

    async def _models(self, request: web.Request) -> web.Response:
        if self._session_of(request) is None:
            return self._error(RequestError(401, "unknown API key", code="invalid_api_key"))
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model",
                                                              "owned_by": "april-ray"}]})

    async def _journal(self, request: web.Request) -> web.Response:
        """`POST /v1/april/journal {"key"}`: the result recorded for the episode's tool call under its
        idempotency key (`{"value"}`), or 404; with `"value"` too, records it (first one kept). Keys of the
        episode's own sample only. The job's tool journal holds them, as it holds an episode handle's calls."""
        session = self._session_of(request)
        try:
            if session is None:
                raise RequestError(401, "unknown API key: each episode has its own", code="invalid_api_key")
            key, value = parse_journal(await request.read())
            if not key.startswith(session.ep.sample.sample_id + "/"):
                raise RequestError(403, "key: not a call of this episode", param="key", code="permission_denied")
            ctx = session.ep.context
            if value is not None:
                await ctx.journal.put(key, {"value": value[0]})
                ctx.tool_stats.calls += 1
                return web.json_response({"key": key})
            answer = await self._recorded(session, key)
        except RequestError as e:
            return self._error(e)
        except (TypeError, ValueError) as e:  # a value that is not JSON
            return self._error(RequestError(400, f"value: {e}", param="value"))
        if "value" not in answer:  # not an error: the agent runs its tool now
            return web.json_response(RequestError(404, f"no result recorded for {key}", code="not_found").body(),
                                     status=404)
        return web.json_response(answer)

    def _session_of(self, request: web.Request) -> AgentSession | None:
        auth = request.headers.get("Authorization", "")
        return self.sessions.get(auth[len("Bearer "):]) if auth.startswith("Bearer ") else None

    def _error(self, e: RequestError) -> web.Response:
        self.stats.errors += 1
        return web.json_response(e.body(), status=e.status)

    async def _chat(self, request: web.Request) -> web.Response:
        session = self._session_of(request)
        try:
            if session is None:
                raise RequestError(401, "unknown API key: each episode has its own", code="invalid_api_key")
            if request.content_length is not None and request.content_length > MAX_BODY:
                raise RequestError(413, f"the request body is over {MAX_BODY} bytes", code="request_too_large")
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise RequestError(413, f"the request body is over {MAX_BODY} bytes",
                                   code="request_too_large") from None
            req = parse_request(raw)
            async with session.lock:
                self.stats.requests += 1
                body, key = await self.serve(session, req)
                if body["choices"][0]["message"].get("tool_calls"):
                    body[JOURNAL_FIELD] = await self._recorded(session, key)
        except RequestError as e:
            return self._error(e)
        return web.json_response(body, headers={IDEMPOTENCY_HEADER: key})

    async def _recorded(self, session: AgentSession, key: str) -> dict:
        """What the job's tool journal holds under `key` (a journal read, and `april_journal` of a response
        whose turn calls tools): `{"key", "value"}` when a result is recorded (a replay), `{"key"}` when not;
        409 once the job is ending."""
        ctx = session.ep.context
        try:
            recorded = await ctx.journal.begin(key)
        except ToolCallsStopped as e:
            raise RequestError(409, str(e), code="job_ending") from None
        if recorded is None:
            return {"key": key}
        ctx.tool_stats.replays += 1
        return {"key": key, "value": recorded["value"]}

    def render(self, req: ChatRequest) -> list[int]:
        try:
            return list(self.tokenizer.apply_chat_template(for_template(req.messages), tools=req.tools,
                                                           add_generation_prompt=True, tokenize=True,
                                                           return_dict=False))
        except Exception as e:  # the template's own complaint (a role order it refuses, say)
            raise RequestError(400, f"messages: the chat template cannot render them ({e})",
                               param="messages") from None

    async def serve(self, session: AgentSession, req: ChatRequest) -> tuple[dict, str]:
        """The response to one request of `session`'s agent, and its idempotency key."""
        ids = self.render(req)
        ep = session.ep
        if len(ids) >= self.max_model_len:
            raise RequestError(400, f"messages: {len(ids)} tokens leave no room in the context "
                               f"(engine.max_model_len={self.max_model_len})", param="messages",
                               code="context_length_exceeded")
        s = ep.sample
        traj = s.input_ids
        model = [0] * len(s.prompt_ids) + (s.loss_mask if s.loss_mask is not None else [1] * len(s.response_ids))
        i, j = match(ids, traj, model, self.eos, self.tokenizer.decode)
        in_turn = s.episode["in_turn"]
        if j == len(traj) and (i == len(ids) or not in_turn):  # extends it: the new tail is the environment's
            if i < len(ids):
                ep.append_env(ids[i:])
            start = await self._generate(session, req.stop)
        elif i == len(ids) and j < len(traj) and model[j]:  # a replay: the trajectory holds this turn
            end = next((k for k in range(j, len(traj)) if not model[k]), len(traj))
            start = j - len(s.prompt_ids)
            if end == len(traj) and in_turn:  # the interrupted turn goes on
                start = await self._generate(session, req.stop)
        else:
            self.stats.mismatch += 1
            ep.new_segment(ids)
            start = await self._generate(session, req.stop)
        return self._response(session.ep, start, len(ids), req)

    async def _generate(self, session: AgentSession, stop: tuple[str, ...]) -> int:
        """One model turn through the session's handle, kept open across aborts: returns where the turn
        starts in the response."""
        resumed, turns = False, session.ep.turn
        while True:
            try:
                await session.ep.generate(stop=stop)
                self.stats.resumed += resumed
                record = session.ep.sample.episode
                return record["turn_start"] if record["turn"] > turns else len(session.ep.sample.response_ids)
            except Interrupted:
                session.parked = asyncio.get_running_loop().create_future()
                session.cut.set_result(None)
                try:
                    await asyncio.wait_for(asyncio.shield(session.parked), self.park_s)
                except asyncio.TimeoutError:
                    self._drop(session)
                    raise RequestError(408, "the episode was not resumed here within rollout.agent_park_s",
                                       code="episode_moved") from None
                session.parked, resumed = None, True

    def _response(self, ep: Episode, start: int, num_prompt: int, req: ChatRequest) -> tuple[dict, str]:
        s = ep.sample
        end = next((k for k in range(start, len(s.response_ids)) if s.loss_mask and not s.loss_mask[k]),
                   len(s.response_ids))
        turn = s.response_ids[start:end]
        content, calls = self.parse_tools(self.tokenizer.decode(turn, skip_special_tokens=True), req.tools)
        finish = "length" if ep.finish_reason == FinishReason.LENGTH and end == len(s.response_ids) else "stop"
        logprobs = s.logprobs[start:end] if req.logprobs else None
        pieces = [self.tokenizer.decode([t]) for t in turn] if req.logprobs else []
        key = tool_key(dataclasses.replace(s, response_ids=s.response_ids[:end]), 0, 0, "agent")
        return completion(calls, content, finish, num_prompt, turn, logprobs, pieces), key
