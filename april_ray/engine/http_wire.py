"""The guard and wire layer of our engine server (`http_server.Server`): what a request passes before its
handler runs, what its body may hold, the Prometheus text of `/metrics`, and the server's command line.

Guarded as SGLang guards a server started with `--api-key` and `--admin-api-key` (`allowed`), and one
without a key refuses to listen beyond loopback unless told `--allow-keyless-public`; each field of a
body is checked for type and range before anything runs, so a bad request is a 400 naming the field and
fails alone; bodies are capped at the largest legal request (`body_limit`, or `--max-body-mb`) and must
arrive within `--body-timeout-s` (`Door`); connections are capped, and those without a key give way to
keyed clients and time out (`connections.py`).
"""
from __future__ import annotations

import argparse
import asyncio
import ipaddress
import math
import secrets
import socket
import uuid

from aiohttp import web

from april_ray.engine.connections import ACCEPTS_PER_TICK, ConnectionGuard, deepen_accept_queue
from april_ray.engine.sglang_client import API_KEY_PATHS
from april_ray.types import GenerateRequest, SamplingParams


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
    return GenerateRequest(parse_rid(body) or uuid.uuid4().hex, ids, sampling)


def _default(d: dict, key: str, value):
    return value if d.get(key) is None else d[key]


def parse_rid(body: dict) -> str | None:
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise BadRequest(f"rid must be a string (batched requests are not supported), got {type(rid).__name__}")
    return rid


def parse_tags(body: dict) -> list[str]:
    tags = body.get("tags") or ["weights", "kv_cache", "cuda_graph"]
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise BadRequest(f"tags must be a list of names (weights, kv_cache, cuda_graph), got {tags!r}"[:300])
    bad = sorted(set(tags) - {"weights", "kv_cache", "cuda_graph"})
    if bad:
        raise BadRequest(f"tags: unknown {bad} (weights, kv_cache, cuda_graph)")
    return tags


async def read_json(request: web.Request) -> dict:
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
async def bad_requests(request: web.Request, handler):
    """A bad request fails alone, SGLang-style: 400 with {"error": {"message": ...}}."""
    try:
        return await handler(request)
    except BadRequest as e:
        return web.json_response({"error": {"message": str(e)}}, status=400)


class Door:
    """What a request passes before its handler: the key first (a refused client's connection closes after
    the answer, its body unread), then the body whole within the body timeout; a request with a key (any
    request but the open ones, on a server without keys) admits its connection."""

    def __init__(self, connections: ConnectionGuard, api_key: str, admin_api_key: str, max_body_bytes: int,
                 body_timeout_s: float):
        self.connections = connections
        self.api_key, self.admin_api_key = api_key, admin_api_key
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s

    @web.middleware
    async def middleware(self, request: web.Request, handler):
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


def parse_args(argv=None, description: str = "") -> argparse.Namespace:
    """The server's command line (`description`: its --help's first paragraph)."""
    p = argparse.ArgumentParser(description=description.split("\n\n")[0])
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


async def listen(server, args: argparse.Namespace) -> None:
    """Serve `server` (an `http_server.Server`) on --host and --port behind its connection guard, until killed."""
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
