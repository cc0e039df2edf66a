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

Guarded as SGLang guards a server started with `--api-key` and `--admin-api-key`; a bad request is a 400
naming the field and fails alone; bodies, connections and the command line are the wire layer's
(`http_wire.py`, `connections.py`). `/metrics` serves the engine's counters as Prometheus text.

A `/generate` call is a `Call`: it waits at the gate while generation is paused or weights are being
replaced, then runs in the engine; a retracted call re-enters after `/continue_generation` with the
tokens it has (its KV cache dropped, as SGLang's retract does); an abort anywhere returns what it has.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
from dataclasses import dataclass, field

from aiohttp import web

from april_ray.engine.async_engine import AsyncEngine
from april_ray.engine.connections import REASONS, RESERVED_FDS, ConnectionGuard, raise_fd_limit
from april_ray.engine.cpu_engine import LLMEngine
from april_ray.engine.http_weights import Lease, WeightRoutes
from april_ray.engine.http_wire import (BadRequest, Door, bad_requests, body_limit, listen, parse_args, parse_generate,
                                        parse_rid, parse_tags, prometheus, read_json, refuse_keyless_public)
from april_ray.types import FinishReason, GenerateRequest


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
        self.connections = ConnectionGuard(max_connections, header_timeout_s)
        self.door = Door(self.connections, api_key, admin_api_key, max_body_bytes, body_timeout_s)
        self.pause_lease = Lease(lease_s, self.resume, "pause_generation")
        WeightRoutes.__init__(self, weights_root, lease_s)
        self.lease_paths = {"/pause_generation", *self.weight_routes()}

    # -- generate -------------------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.Response:
        body = await read_json(request)
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
        body = await read_json(request)
        rid = parse_rid(body)
        if body.get("abort_all"):
            for call in list(self.calls.values()):
                self.abort_call(call)
        elif rid in self.calls:  # as SGLang: a rid it knows, then every request whose rid begins with it
            for call in [c for r, c in self.calls.items() if r.startswith(rid)]:
                self.abort_call(call)
        return web.Response()

    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = (await read_json(request)).get("mode") or "abort"
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
        self.core.release_memory(parse_tags(await read_json(request)))
        return web.json_response(None)

    async def resume_memory(self, request: web.Request) -> web.Response:
        self.core.resume_memory(parse_tags(await read_json(request)))
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
        app = web.Application(middlewares=[self.door.middleware, self._keep_leases, bad_requests],
                              client_max_size=self.door.max_body_bytes)
        post = {"/generate": self.generate, "/abort_request": self.abort_request,
                "/pause_generation": self.pause_generation, "/continue_generation": self.continue_generation,
                "/release_memory_occupation": self.release_memory, "/resume_memory_occupation": self.resume_memory,
                "/flush_cache": self.flush_cache, **self.weight_routes()}
        get = {"/health": self.health, "/health_generate": self.health, "/model_info": self.model_info,
               "/get_model_info": self.model_info, "/get_server_info": self.server_info,
               "/server_info": self.server_info, "/flush_cache": self.flush_cache, "/metrics": self.metrics}
        app.add_routes([web.post(p, h) for p, h in post.items()] + [web.get(p, h) for p, h in get.items()])
        return app

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


def build_server(args: argparse.Namespace) -> Server:
    import torch

    from april_ray.engine.qwen3 import load_qwen3

    torch.set_num_threads(args.num_threads)
    model = load_qwen3(args.model_path, getattr(torch, args.dtype))
    model.to(args.device)
    eos_ids = model.config.eos_token_id
    core = LLMEngine(model, args.max_num_seqs, args.max_model_len, args.max_prefill_tokens, args.seed, 0,
                     num_park_slots=args.park_slots, max_versions=args.max_versions)
    limit = int(args.max_body_mb * (1 << 20)) if args.max_body_mb else body_limit(args.max_model_len)
    return Server(AsyncEngine(core), args.model_path, eos_ids, args.weight_version, api_key=args.api_key,
                  admin_api_key=args.admin_api_key, weights_root=args.weights_root, lease_s=args.lease_s,
                  max_body_bytes=limit, body_timeout_s=args.body_timeout_s,
                  max_connections=min(args.max_connections, raise_fd_limit() - RESERVED_FDS),
                  header_timeout_s=args.header_timeout_s)


async def serve(args: argparse.Namespace) -> None:
    """Load the model and serve it until killed."""
    await listen(build_server(args), args)


def main(argv=None) -> None:
    args = parse_args(argv, __doc__)
    refuse_keyless_public(args.host, args.api_key, args.allow_keyless_public)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
