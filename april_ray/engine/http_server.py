"""Our CPU engine behind SGLang's HTTP API, so the SGLang client, its abort and pause semantics and the
weight-sync paths run end to end without a GPU (and, with `--device cuda`, on one).

    python -m april_ray.engine.http_server --model-path DIR --port N [--host 127.0.0.1] [--max-num-seqs 64]

Field names, defaults and replies follow SGLang's `srt/entrypoints/http_server.py` and
`srt/managers/io_struct.py` (0.5.x) for what april-ray uses: `/generate` with `input_ids` only (a server
started with `--skip-tokenizer-init`), `/abort_request`, `/pause_generation` (abort | retract | in_place),
`/continue_generation`, the weight endpoints (`http_weights.py`), memory release and resume, `/flush_cache`,
`/health`, `/model_info`, `/get_server_info`. Differences: per-token versions come back exactly as
`meta_info.weight_versions` spans (SGLang reports the same field); `kv_cache` release also drops the
parked caches of aborted requests (our prefix cache).

Guarded as SGLang guards a server started with `--api-key` and `--admin-api-key` (`allowed`), and one
without a key refuses to listen beyond loopback unless told `--allow-keyless-public`; each field of a
body is checked for type and range before anything runs, so a bad request is a 400 naming the field and
fails alone; bodies are capped at the largest legal request (`body_limit`, or `--max-body-mb`) and must
arrive within `--body-timeout-s`; connections are capped, and those without a key give way to keyed
clients and time out (`connections.py`). `/metrics` serves the engine's counters as Prometheus text.

A `/generate` call is a `Call`: it waits at the gate while generation is paused or weights are being
replaced, then runs in the engine; a retracted call re-enters after `/continue_generation` with the
tokens it has (its KV cache dropped, as SGLang's retract does); an abort anywhere returns what it has.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import ipaddress
import math
import secrets
import socket
import uuid
from dataclasses import dataclass, field

from aiohttp import web

from april_ray.engine.async_engine import AsyncEngine
from april_ray.engine.connections import (ACCEPTS_PER_TICK, REASONS, RESERVED_FDS, ConnectionGuard,
                                          deepen_accept_queue, raise_fd_limit)
from april_ray.engine.cpu_engine import LLMEngine
from april_ray.engine.http_weights import Lease, WeightRoutes
from april_ray.engine.sglang_client import API_KEY_PATHS
from april_ray.types import FinishReason, GenerateRequest, SamplingParams


class BadRequest(ValueError):
    """A client error: answered with 400 and the message, and nothing else is touched."""


SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos"}
NEUTRAL = {"no_stop_trim": None, "skip_special_tokens": None, "spaces_between_special_tokens": None,
           "min_new_tokens": 0, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
           "repetition_penalty": 1.0, "n": 1, "stop": None, "sampling_seed": None}
"""Keys accepted only at values that change nothing here (None: any value). output_ids always end with
the matched stop token, as SGLang's do with --skip-tokenizer-init whatever no_stop_trim says."""


GREEDY_BELOW = 1e-6
"""A temperature under this samples greedily, as in SGLang (logits / 1e-40 overflow float32)."""


def parse_sampling(sp, eos_ids: tuple[int, ...]) -> SamplingParams:
    """Every field checked for type and range here, so nothing a client sends can fail the engine's step."""
    if not isinstance(sp, dict):
        raise BadRequest(f"sampling_params must be a JSON object, got {type(sp).__name__}")
    for key, value in sp.items():
        if key not in SAMPLING_KEYS and key not in NEUTRAL:
            raise BadRequest(f"sampling_params.{key} is not supported by this server "
                             f"(supported: {sorted(SAMPLING_KEYS | set(NEUTRAL))})")
        if key in NEUTRAL and NEUTRAL[key] is not None and value not in (None, NEUTRAL[key]):
            raise BadRequest(f"sampling_params.{key}={value!r} is not supported (only {NEUTRAL[key]!r})")
    temperature = _field(sp, "temperature", 1.0, float, lambda v: 0 <= v < math.inf, "a finite number >= 0")
    top_p = _field(sp, "top_p", 1.0, float, lambda v: 0 < v <= 1, "in (0, 1]")
    top_k = _field(sp, "top_k", -1, int, lambda v: v == -1 or v >= 1, "-1 or >= 1")
    max_new_tokens = _field(sp, "max_new_tokens", 128, int, lambda v: v >= 1, "an integer >= 1")
    stop = _field(sp, "stop_token_ids", [], list, lambda v: all(_is(t, int) for t in v), "a list of token ids")
    ignore_eos = _field(sp, "ignore_eos", False, bool, lambda v: True, "true or false")
    # as SGLang: stop at the request's stop ids and the model's EOS ids; ignore_eos turns off both
    stop = () if ignore_eos else tuple(stop) + tuple(t for t in eos_ids if t not in stop)
    return SamplingParams(temperature=0.0 if temperature < GREEDY_BELOW else temperature, top_p=top_p,
                          top_k=-1 if top_k >= 1 << 30 else top_k, max_new_tokens=max_new_tokens, stop_token_ids=stop)


def _is(value, kind: type) -> bool:
    """JSON's types: a bool is not a number, an integer is a float."""
    if isinstance(value, bool):
        return kind is bool
    return isinstance(value, (int, float) if kind is float else kind)


def _field(sp: dict, key: str, default, kind: type, ok, rule: str):
    value = sp.get(key)
    if value is None:
        return default
    if not _is(value, kind) or not ok(value):
        raise BadRequest(f"sampling_params.{key} must be {rule}, got {value!r}"[:300])
    return kind(value) if kind is float else value


def parse_generate(body: dict, eos_ids: tuple[int, ...]) -> GenerateRequest:
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    if body.get("stream"):
        raise BadRequest("stream=true is not supported by this server")
    ids = body.get("input_ids")
    if ids is None:
        raise BadRequest("input_ids is required (this server has no tokenizer: text is not accepted)")
    if not isinstance(ids, list) or not all(_is(t, int) for t in ids):
        raise BadRequest("input_ids must be one list of token ids (batched requests are not supported)")
    sampling = parse_sampling(_default(body, "sampling_params", {}), eos_ids)
    return GenerateRequest(_rid(body) or uuid.uuid4().hex, ids, sampling)


def _default(d: dict, key: str, value):
    return value if d.get(key) is None else d[key]


def _rid(body: dict) -> str | None:
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise BadRequest(f"rid must be a string (batched requests are not supported), got {type(rid).__name__}")
    return rid


@dataclass
class Call:
    """One /generate call across retractions: what it generated so far and how it may end."""

    request: GenerateRequest
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    in_engine: bool = False
    aborted: bool = False
    retracted: bool = False
    waiter: asyncio.Future | None = None
    finish: FinishReason | None = None


class Server(WeightRoutes):
    def __init__(self, engine: AsyncEngine, model_path: str, eos_ids: tuple[int, ...], weight_version: str = "0",
                 api_key: str = "", admin_api_key: str = "", weights_root: str = "", lease_s: float = 300.0,
                 max_body_bytes: int = 4 << 20, body_timeout_s: float = 60.0, max_connections: int = 4096,
                 header_timeout_s: float = 10.0):
        self.engine, self.core = engine, engine.engine
        self.model_path = model_path
        self.eos_ids = eos_ids
        self.calls: dict[str, Call] = {}
        self.closed_by: set[str] = set()
        """Why new and retracted calls wait: 'paused' (/pause_generation), 'weights' (an update)."""
        self.idle = asyncio.Condition()
        self.version_names = {self.core.version: weight_version}
        self.weight_version = weight_version
        self.api_key, self.admin_api_key, self.max_body_bytes = api_key, admin_api_key, max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.connections = ConnectionGuard(max_connections, header_timeout_s)
        self.pause_lease = Lease(lease_s, self.resume, "pause_generation")
        WeightRoutes.__init__(self, weights_root, lease_s)
        self.lease_paths = {"/pause_generation", *self.weight_routes()}

    # -- generate -------------------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.Response:
        body = await _json(request)
        req = parse_generate(body, self.eos_ids)
        if req.request_id in self.calls:
            raise BadRequest(f"rid {req.request_id!r} is already running")
        call = self.calls[req.request_id] = Call(req)
        try:
            await self._run(call)
        finally:
            del self.calls[req.request_id]
            async with self.idle:
                self.idle.notify_all()
        return web.json_response(self._reply(call, bool(body.get("return_logprob"))))

    async def _run(self, call: Call) -> None:
        req = call.request
        while not call.aborted and await self._admitted(call):
            left = req.sampling.max_new_tokens - len(call.tokens)
            sp = dataclasses.replace(req.sampling, max_new_tokens=left)
            call.in_engine, call.retracted = True, False
            try:
                out = await self.engine.generate(GenerateRequest(req.request_id, req.input_ids + call.tokens, sp))
            except ValueError as e:
                raise BadRequest(str(e)) from None
            finally:
                call.in_engine = False
            call.tokens += out.token_ids
            call.logprobs += out.logprobs
            call.versions += out.versions
            call.cached_tokens += out.cached_tokens
            if out.finish_reason != FinishReason.ABORT:
                call.finish = out.finish_reason
                return
        call.finish = FinishReason.ABORT

    async def _admitted(self, call: Call) -> bool:
        """Wait while the gate is closed; False if the call was aborted meanwhile. A retracted call that
        finds the gate open already (continue came first) goes straight back in."""
        if not self.closed_by:
            return not call.aborted
        call.waiter = asyncio.get_running_loop().create_future()
        try:
            return await call.waiter
        finally:
            call.waiter = None

    def _open(self, reason: str) -> None:
        self.closed_by.discard(reason)
        if not self.closed_by:
            for call in self.calls.values():
                if call.waiter is not None and not call.waiter.done():
                    call.waiter.set_result(True)

    def _reply(self, call: Call, request_logprobs: bool) -> dict:
        n, finish = len(call.tokens), call.finish
        if finish == FinishReason.STOP:
            reason = {"type": "stop", "matched": call.tokens[-1]}
        elif finish == FinishReason.LENGTH:
            reason = {"type": "length", "length": n}
        else:
            reason = {"type": "abort", "message": "Request aborted."}
        meta = {"id": call.request.request_id, "finish_reason": reason, "prompt_tokens": len(call.request.input_ids),
                "completion_tokens": n, "cached_tokens": call.cached_tokens, "weight_version": self.weight_version,
                "weight_versions": self._spans(call.versions)}
        if request_logprobs:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(call.logprobs, call.tokens)]
        return {"output_ids": call.tokens, "meta_info": meta}

    def _spans(self, versions: list[int]) -> list[dict]:
        spans: list[dict] = []
        for i, v in enumerate(versions):
            name = self.version_names.get(v, str(v))
            if spans and spans[-1]["version"] == name:
                spans[-1]["end"] = i + 1
            else:
                spans.append({"version": name, "start": i, "end": i + 1})
        return spans

    # -- abort and pause ------------------------------------------------------------------------------
    def abort_call(self, call: Call) -> None:
        call.aborted = True
        if call.in_engine:
            self.engine.abort(call.request.request_id)
        if call.waiter is not None and not call.waiter.done():
            call.waiter.set_result(False)

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _json(request)
        rid = _rid(body)
        if body.get("abort_all"):
            for call in list(self.calls.values()):
                self.abort_call(call)
        elif rid in self.calls:
            self.abort_call(self.calls[rid])
        return web.Response()

    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = (await _json(request)).get("mode") or "abort"
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"mode must be abort, retract or in_place, got {mode!r}")
        self.closed_by.add("paused")
        self.pause_lease.renew()
        if mode == "abort":
            for call in list(self.calls.values()):
                self.abort_call(call)
        elif mode == "retract":  # back to waiting, caches dropped: recomputed after continue
            for call in self.calls.values():
                if call.in_engine:
                    call.retracted = True
                    self.engine.abort(call.request.request_id, park=False)
        else:
            self.engine.hold()
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    def resume(self) -> None:
        self.pause_lease.cancel()
        self.engine.release()
        self._open("paused")

    @contextlib.asynccontextmanager
    async def exclusive(self, abort_all: bool = False):
        """For a weight update: while generation is paused it goes at once (SGLang does the same); else new
        calls wait and the update waits for the running ones to finish (or aborts them)."""
        if "paused" in self.closed_by:
            yield
            return
        self.closed_by.add("weights")
        try:
            if abort_all:
                for call in list(self.calls.values()):
                    self.abort_call(call)
            async with self.idle:
                await self.idle.wait_for(lambda: not any(c.in_engine for c in self.calls.values()))
            yield
        finally:
            self._open("weights")

    def set_version(self, name: str) -> None:
        """Tokens sampled from now on carry this version (an int for the engine; other names are numbered)."""
        version = int(name) if name.lstrip("-").isdigit() else self.core.version + 1
        self.version_names[version] = self.weight_version = str(name)
        self.engine.update_weights(None, version)

    # -- memory, cache, info --------------------------------------------------------------------------
    def _refuse_if_busy(self, what: str) -> None:
        if self.calls or self.core.has_work():
            raise BadRequest(f"{what}: {len(self.calls)} requests are running or waiting; it needs an idle server")

    async def release_memory(self, request: web.Request) -> web.Response:
        self._refuse_if_busy("release_memory_occupation")
        self.core.release_memory(_tags(await _json(request)))
        return web.json_response(None)

    async def resume_memory(self, request: web.Request) -> web.Response:
        self.core.resume_memory(_tags(await _json(request)))
        return web.json_response(None)

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.calls or self.core.has_work():
            return web.Response(status=400, text="Flush cache failed: requests are running or waiting.\n")
        self.core.flush_cache()
        return web.Response(text="Cache flushed.\n")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_path, "tokenizer_path": self.model_path,
                                  "is_generation": True, "weight_version": self.weight_version})

    async def server_info(self, request: web.Request) -> web.Response:
        st = self.core.stats(drain=False)
        return web.json_response({
            "model_path": self.model_path, "weight_version": self.weight_version, "paused": bool(self.closed_by),
            "max_num_seqs": self.core.scheduler.max_num_seqs, "max_model_len": self.core.max_model_len,
            "num_running": st.num_running, "num_waiting": st.num_waiting, "num_calls": len(self.calls),
            "num_generated_tokens": st.num_generated_tokens, "num_prefill_tokens": st.num_prefill_tokens,
            "num_reused_tokens": st.num_reused_tokens, "num_parked": st.num_parked, "busy_s": st.busy_s,
            "released": sorted(self.core.released)})

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._door, self._keep_leases, _errors], client_max_size=self.max_body_bytes)
        post = {"/generate": self.generate, "/abort_request": self.abort_request,
                "/pause_generation": self.pause_generation, "/continue_generation": self.continue_generation,
                "/release_memory_occupation": self.release_memory, "/resume_memory_occupation": self.resume_memory,
                "/flush_cache": self.flush_cache, **self.weight_routes()}
        get = {"/health": self.health, "/health_generate": self.health, "/model_info": self.model_info,
               "/get_model_info": self.model_info, "/get_server_info": self.server_info,
               "/server_info": self.server_info, "/flush_cache": self.flush_cache, "/metrics": self.metrics}
        app.add_routes([web.post(p, h) for p, h in post.items()] + [web.get(p, h) for p, h in get.items()])
        return app


    @web.middleware
    async def _door(self, request: web.Request, handler):
        """The key first (a refused client's connection closes after the answer, its body unread), then the body
        whole within the body timeout, then the handler; a request with a key (any request but the open ones,
        on a server without keys) admits its connection."""
        transport = request.transport
        self.connections.request_started(transport)
        try:
            authorization = request.headers.get("Authorization")
            if not allowed(request.path, authorization, self.api_key, self.admin_api_key):
                return _closing(web.json_response({"error": "Unauthorized"}, status=401))
            if not request.path.startswith(OPEN_PREFIXES) or has_key(authorization, self.api_key, self.admin_api_key):
                self.connections.admit(transport)  # (our client sends its key to /health too)
            if (request.content_length or 0) > self.max_body_bytes:
                return _closing(_error(413, f"the body ({request.content_length} bytes) is over this server's limit "
                                            f"of {self.max_body_bytes} bytes (--max-body-mb)"))
            if request.body_exists:
                try:
                    await asyncio.wait_for(request.read(), self.body_timeout_s)
                except asyncio.TimeoutError:
                    self.connections.body_timed_out()
                    return _closing(_error(408, f"the body did not arrive within {self.body_timeout_s:g}s "
                                                f"(--body-timeout-s)"))
            return await handler(request)
        finally:
            self.connections.request_ended(transport)

    async def metrics(self, request: web.Request) -> web.Response:
        st, guard = self.core.stats(drain=False), self.connections
        return web.Response(text=prometheus([
            ("running_requests", "gauge", "Sequences in the engine's running batch.", st.num_running),
            ("waiting_requests", "gauge", "Sequences waiting for a place in the batch.", st.num_waiting),
            ("calls", "gauge", "/generate calls open (running, waiting or paused).", len(self.calls)),
            ("parked_caches", "gauge", "Aborted sequences whose KV cache is parked.", st.num_parked),
            ("paused", "gauge", "1 while generation is paused or weights are being replaced.",
             int(bool(self.closed_by))),
            ("generated_tokens_total", "counter", "Tokens sampled since the server started.", st.num_generated_tokens),
            ("prefill_tokens_total", "counter", "Prompt tokens prefilled.", st.num_prefill_tokens),
            ("reused_tokens_total", "counter", "Prefill tokens served from parked caches.", st.num_reused_tokens),
            ("busy_seconds_total", "counter", "Wall time inside forward passes and sampling.", st.busy_s),
            ("connections", "gauge", "Open client connections, by whether a request on them had the key.",
             {'state="admitted"': len(guard.admitted), 'state="pending"': len(guard.pending)}),
            ("connections_closed_total", "counter", "Connections closed or refused by the guard, and requests "
             "whose body timed out, by reason.", {f'reason="{r}"': guard.totals[r] for r in sorted(REASONS)}),
        ]), content_type="text/plain", charset="utf-8", headers={"X-Content-Type-Options": "nosniff"})

    @web.middleware
    async def _keep_leases(self, request: web.Request, handler):
        """A weight update's own calls (the pause, the session, the updates) keep an open pause and session
        alive, before and after each; other admin calls (the engine's aborts) do not, so a pause whose
        learner died ends even while its engine keeps aborting."""
        if request.path not in self.lease_paths:
            return await handler(request)
        for lease in (self.pause_lease, self.session_lease):
            lease.touch()
        try:
            return await handler(request)
        finally:
            for lease in (self.pause_lease, self.session_lease):
                lease.touch()


OPEN_PREFIXES = ("/health", "/ready", "/metrics")


def allowed(path: str, authorization: str | None, api_key: str, admin_api_key: str) -> bool:
    """SGLang 0.5.23's rule (`srt/utils/auth.py`): health and metrics are open; an admin endpoint takes the
    admin key when one is set, else the API key; the others take the API key when one is set."""
    if path.startswith(OPEN_PREFIXES):
        return True
    key = api_key if path in API_KEY_PATHS else admin_api_key or api_key
    if not key:
        return True
    return has_key(authorization, key)


def has_key(authorization: str | None, *keys: str) -> bool:
    """Whether the header is `Bearer <one of keys>` (empty keys match nothing)."""
    scheme, _, token = (authorization or "").partition(" ")
    # aiohttp hands bytes that are not UTF-8 over as surrogates: they go back to the bytes that were sent
    sent = token.encode(errors="surrogateescape")
    return scheme.lower() == "bearer" and any([secrets.compare_digest(sent, k.encode()) for k in keys if k])


def prometheus(metrics: list) -> str:
    """Prometheus' text format of (name, type, help, value or {labels: value}), each name `april_engine_`."""
    lines = []
    for name, kind, help_, value in metrics:
        name = f"april_engine_{name}"
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        samples = value if isinstance(value, dict) else {"": value}
        lines += [f"{name}{{{labels}}} {v}" if labels else f"{name} {v}" for labels, v in samples.items()]
    return "\n".join(lines) + "\n"


def refuse_keyless_public(host: str, api_key: str, allow: bool) -> None:
    """A server without an API key serves anyone who reaches it (admin endpoints too, without an admin
    key): beyond loopback that must be what the operator asked for."""
    if api_key or allow or is_loopback(host):
        return
    raise SystemExit(f"error: --host {host!r} is not a loopback address and this server has no --api-key: anyone "
                     f"who reaches it could generate, pause it and replace its weights. Pass --api-key and "
                     f"--admin-api-key, or --allow-keyless-public if that is what you mean")


def is_loopback(host: str) -> bool:
    """Whether every address `host` binds to is a loopback one (a wildcard or an unknown name is not)."""
    try:
        infos = socket.getaddrinfo(host or None, None, proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return False
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def body_limit(max_model_len: int) -> int:
    """The largest legal request, with room: a /generate of max_model_len token ids (under 16 bytes each in
    JSON), or a weight update's metadata and handles (4 MiB holds thousands of tensors' worth)."""
    return max(4 << 20, 16 * max_model_len + (64 << 10))


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def _closing(response: web.Response) -> web.Response:
    """The connection closes after this answer (a refused client keeps no slot; an unread body is dropped)."""
    response.force_close()
    return response


def _tags(body: dict) -> list[str]:
    tags = body.get("tags") or ["weights", "kv_cache", "cuda_graph"]
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise BadRequest(f"tags must be a list of names (weights, kv_cache, cuda_graph), got {tags!r}"[:300])
    bad = sorted(set(tags) - {"weights", "kv_cache", "cuda_graph"})
    if bad:
        raise BadRequest(f"tags: unknown {bad} (weights, kv_cache, cuda_graph)")
    return tags


async def _json(request: web.Request) -> dict:
    """The body as a JSON object (every endpoint here takes one)."""
    if not request.body_exists:  # (read whole already by the door: `can_read_body` is False by now)
        return {}
    try:
        body = await request.json()
    except ValueError as e:
        raise BadRequest(f"the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
    return body


@web.middleware
async def _errors(request: web.Request, handler):
    """A bad request fails alone, SGLang-style: 400 with {"error": {"message": ...}}."""
    try:
        return await handler(request)
    except BadRequest as e:
        return web.json_response({"error": {"message": str(e)}}, status=400)


def build_server(args: argparse.Namespace) -> Server:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.num_threads)
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=getattr(torch, args.dtype)).eval()
    model.to(args.device)
    eos = model.generation_config.eos_token_id if model.generation_config else model.config.eos_token_id
    eos_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
    core = LLMEngine(model, args.max_num_seqs, args.max_model_len, args.max_prefill_tokens, args.seed, 0,
                     num_park_slots=args.park_slots, max_versions=args.max_versions)
    limit = int(args.max_body_mb * (1 << 20)) if args.max_body_mb else body_limit(args.max_model_len)
    return Server(AsyncEngine(core), args.model_path, eos_ids, args.weight_version, api_key=args.api_key,
                  admin_api_key=args.admin_api_key, weights_root=args.weights_root, lease_s=args.lease_s,
                  max_body_bytes=limit, body_timeout_s=args.body_timeout_s,
                  max_connections=min(args.max_connections, raise_fd_limit() - RESERVED_FDS),
                  header_timeout_s=args.header_timeout_s)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, help="Hugging Face directory of a Qwen3-architecture model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0: choose a free port (printed, and written to --port-file)")
    p.add_argument("--port-file", default="", help="write the port here once listening")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=640)
    p.add_argument("--max-prefill-tokens", type=int, default=8192)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--park-slots", type=int, default=0, help="spare KV slots keeping aborted requests' caches")
    p.add_argument("--max-versions", type=int, default=0,
                   help="versions a parked cache may lag the weights and still be reused")
    p.add_argument("--weight-version", default="0")
    p.add_argument("--api-key", default="", help="Bearer key of /generate and the info endpoints (empty: open)")
    p.add_argument("--admin-api-key", default="", help="Bearer key of the admin endpoints (empty: the API key)")
    p.add_argument("--weights-root", default="",
                   help="/update_weights_from_disk also loads from under this directory (always: the model's)")
    p.add_argument("--lease-s", type=float, default=300.0,
                   help="a pause or a weight-update session ends after this long without an admin call")
    p.add_argument("--max-body-mb", type=float, default=0.0,
                   help="largest request body; 0: sized to the largest legal request (by --max-model-len)")
    p.add_argument("--body-timeout-s", type=float, default=60.0, help="a request's body must arrive whole within this")
    p.add_argument("--header-timeout-s", type=float, default=10.0,
                   help="a connection without a keyed request is closed when no request arrives for this long")
    p.add_argument("--max-connections", type=int, default=4096,
                   help="open connections at most (also kept below the open-file limit); at the cap a new one "
                        "replaces the oldest without a keyed request, or is refused")
    p.add_argument("--allow-keyless-public", action="store_true",
                   help="start without --api-key on an address other than loopback")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    server = build_server(args)
    runner = web.AppRunner(server.app(), access_log=None, keepalive_timeout=KEEPALIVE_S)
    await runner.setup()
    loop = asyncio.get_running_loop()
    listener = await loop.create_server(server.connections.protocol_factory(runner.server), args.host, args.port,
                                        backlog=ACCEPTS_PER_TICK, reuse_address=True)
    deepen_accept_queue(listener)
    server.connections.start(loop)
    port = listener.sockets[0].getsockname()[1]
    if args.port_file:
        with open(args.port_file, "w") as f:
            f.write(str(port))
    print(f"april-ray engine server on http://{args.host}:{port} (model {args.model_path}, {args.device}; "
          f"at most {server.connections.max_connections} connections)", flush=True)
    await asyncio.Event().wait()


KEEPALIVE_S = 75.0
"""An idle keep-alive connection closes after this (longer than aiohttp's client pool keeps one, 15 s, so
a client never reuses a connection the server is closing)."""


def main(argv=None) -> None:
    args = parse_args(argv)
    refuse_keyless_public(args.host, args.api_key, args.allow_keyless_public)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
