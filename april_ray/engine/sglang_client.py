"""`SGLangEngine`: the `engine.base.Engine` protocol over SGLang's HTTP API, so an `EngineWorker` drives a
real `sglang.launch_server` (GPU nodes) or our CPU server (`http_server.py`) exactly as it drives the
in-actor engine.

- `generate` sends `input_ids` (a resumed sample: prompt + its tokens) with the remaining budget, clamped
  to the context as our engine does, and maps the reply back: `output_ids`, the logprobs of
  `output_token_logprobs`, per-token versions from `weight_versions` spans (or `weight_version` for
  servers that report only that), and `finish_reason.type` stop | length | abort. An aborted request
  returns its partial tokens. A request with `stop_token_ids` (the job's: the tokenizer's EOS) stops at
  them and, as SGLang always does, at the model's own EOS ids; one without any runs to its budget, as in
  our engine: it goes out with `ignore_eos`, which in SGLang turns off every token stop.
- `abort`, `abort_tagged` and `abort_all` are immediate for the caller and finish in the background:
  `abort_tagged` (one step's requests) posts each matching request's rid, and posts again those still in
  flight (a request can reach the server after its abort did: SGLang drops an abort for a rid it does not
  know yet) until none is left, a bounded number of times. `abort_all` posts SGLang's `abort_all` first,
  then does the same for the requests in flight when it was called, so a request of the next step is
  never caught. Each rid begins with a fresh uuid: SGLang's scheduler aborts every request whose rid
  begins with the one aborted, and no rid of ours begins with another.
- `update_weights(None, version)` adopts the version of weights that the learner delivered itself
  (april_ray/weights/: broadcast, tensor handoff or disk, each stamping `weight_version`); the async
  methods below are those deliveries' HTTP half, and pause / continue, memory release / resume,
  `flush_cache`. `update_weights(state_dict, version)` (weights through Ray's object store) hands the
  tensors to the server by handle from this process, on the same node: shared memory.
- Every call carries SGLang's `Authorization: Bearer` key: the API key for generation and information, the
  admin key for everything else (`API_KEY_PATHS`), as a server started with both keys requires.
- `stats` is counted here from the replies: generated = completion tokens, prefill = prompt tokens not
  served from the server's prefix cache, reused = `cached_tokens`; occupancy is requests in flight.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid

import aiohttp

from april_ray.engine.base import BadRequestError, ServerError
from april_ray.types import EngineStats, FinishReason, GenerateOutput, GenerateRequest

log = logging.getLogger(__name__)

FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
API_KEY_PATHS = {"/generate", "/model_info", "/get_model_info", "/get_server_info", "/server_info"}
"""SGLang's endpoints under `--api-key`; the others (abort, pause, weights, memory, cache) take
`--admin-api-key` when it is set, and /health, /metrics none."""


class SGLangEngine:
    def __init__(self, url: str, version: int = 0, max_model_len: int | None = None, server=None,
                 flush_on_update: bool = True, bucket_mb: float = 512.0, timeout_s: float = 3600.0,
                 abort_retries: int = 50, abort_interval_s: float = 0.05, api_key: str | None = None,
                 admin_api_key: str | None = None):
        """`server`: the `sglang_server.ServerProcess` behind `url`, if we started it (errors then carry
        its log tail). `max_model_len`: the server's context length, to clamp budgets as our engine does.
        `flush_on_update`: drop the server's prefix cache with each weight update (false keeps caches of
        older weights, within the server's own staleness bound). The keys default to `server`'s; a learner
        that only sends weights needs the admin key alone."""
        self.url = url.rstrip("/")
        self.version = version
        self.max_model_len = max_model_len
        self.server = server
        self.api_key = api_key if api_key is not None else getattr(server, "api_key", "")
        self.admin_api_key = admin_api_key if admin_api_key is not None else getattr(server, "admin_api_key", "")
        self.flush_on_update, self.bucket_mb = flush_on_update, bucket_mb
        self.timeout_s = timeout_s
        self.abort_retries, self.abort_interval_s = abort_retries, abort_interval_s
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}
        self._admin: asyncio.AbstractEventLoop | None = None
        self._rids: dict[str, str] = {}
        """Our request id -> the server's rid, for requests in flight."""
        self._tasks: set[asyncio.Task] = set()
        self.num_generated_tokens = self.num_prefill_tokens = self.num_reused_tokens = 0
        self.busy_s, self._busy_since = 0.0, 0.0
        self.occupancy: list[tuple[float, int]] = []

    # -- HTTP -----------------------------------------------------------------------------------------
    def _http(self) -> aiohttp.ClientSession:
        """One session per event loop: the actor's, the admin thread's, and each `asyncio.run` of a learner."""
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            self._sessions = {lp: s for lp, s in self._sessions.items() if not lp.is_closed()}
            session = self._sessions[loop] = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return session

    async def request(self, method: str, path: str, body: dict | None = None, ok_400: bool = False):
        """JSON in, JSON (or text) out; a failure raises with the URL, the status and the server's answer."""
        url = f"{self.url}{path}"
        key = self.api_key if path in API_KEY_PATHS else self.admin_api_key
        headers = {"Authorization": f"Bearer {key}"} if key else None
        try:
            async with self._http().request(method, url, json=body, headers=headers) as r:
                text = await r.text()
                if r.status == 400 and ok_400:
                    return None
                if r.status != 200:
                    err = BadRequestError if r.status == 400 else ServerError
                    raise err(f"{method} {url} -> {r.status}: {text[:2000]}")
                return await r.json(content_type=None) if text and r.content_type == "application/json" else text
        except aiohttp.ClientError as e:
            if self.server is not None and not self.server.alive():
                raise self.server.died() from e
            raise ServerError(f"{method} {url} failed: {type(e).__name__}: {e}") from e

    async def close(self) -> None:
        session = self._sessions.pop(asyncio.get_running_loop(), None)
        if session is not None:
            await session.close()

    def _blocking(self, coro_fn):
        """Run `coro_fn()` to completion for synchronous code, on a thread with an event loop of its own
        (the caller may be running on the actor's loop, which must not be re-entered)."""
        if self._admin is None:
            self._admin = asyncio.new_event_loop()
            threading.Thread(target=self._admin.run_forever, daemon=True, name="sglang-client-admin").start()
        return asyncio.run_coroutine_threadsafe(coro_fn(), self._admin).result()

    def _background(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- the Engine protocol --------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        sp, ids = request.sampling, request.input_ids
        budget = sp.max_new_tokens if self.max_model_len is None else min(sp.max_new_tokens,
                                                                           self.max_model_len - len(ids))
        rid = f"{uuid.uuid4().hex}-{request.request_id}"
        body = {"rid": rid, "input_ids": ids, "return_logprob": True, "logprob_start_len": -1,
                "sampling_params": {"max_new_tokens": max(budget, 1), "temperature": sp.temperature,
                                    "top_p": sp.top_p, "top_k": sp.top_k, "stop_token_ids": list(sp.stop_token_ids),
                                    "ignore_eos": not sp.stop_token_ids, "no_stop_trim": True, "skip_special_tokens": False}}
        self._track(request.request_id, rid)
        try:
            reply = await self.request("POST", "/generate", body)
        except asyncio.CancelledError:  # the caller gave up (e.g. ray.cancel): free the server's slot too
            self._background(self.request("POST", "/abort_request", {"rid": rid}))
            raise
        finally:
            self._track(request.request_id, None)
        return self._output(request.request_id, reply)

    def abort(self, request_id: str, park: bool = True) -> bool:
        rid = self._rids.get(request_id)
        if rid is not None:
            self._background(self.request("POST", "/abort_request", {"rid": rid}))
        return rid is not None

    def abort_tagged(self, tag: str) -> int:
        n = sum(request_id.endswith(tag) for request_id in self._rids)
        if n:
            self._background(self._abort_until_gone(lambda request_id, rid: request_id.endswith(tag)))
        return n

    def abort_all(self) -> int:
        ours = set(self._rids.values())
        if ours:
            self._background(self._abort_until_gone(lambda request_id, rid: rid in ours, everything=True))
        return len(ours)

    def update_weights(self, state_dict, version: int) -> None:
        """Blocks until the server has loaded them, as our engine's in-place update does: between steps."""
        if state_dict is not None:
            from april_ray.engine.weight_handoff import send_tensors

            named = list(state_dict.items())
            self._blocking(lambda: send_tensors(self, named, version, self.flush_on_update, self.bucket_mb))
        self.version = version

    def set_kv_reuse(self, enabled: bool) -> None:
        """The in-actor engine's benchmark switch (jobs/bench/rollout.py). A server's prefix cache is its own
        configuration: reuse on is what it does already; off cannot be asked for over SGLang's API."""
        if not enabled:
            raise NotImplementedError(f"{self.url}: switching KV reuse off at run time is not in SGLang's API")

    def stats(self, drain: bool = True) -> EngineStats:
        occupancy = self.occupancy
        if drain:
            self.occupancy = []
        busy = self.busy_s + (time.perf_counter() - self._busy_since if self._rids else 0.0)
        return EngineStats(self.num_generated_tokens, self.num_prefill_tokens, busy, len(self._rids), 0,
                           self.version, occupancy, self.num_reused_tokens)

    def _track(self, request_id: str, rid: str | None) -> None:
        now = time.perf_counter()
        if rid is not None:
            if not self._rids:
                self._busy_since = now
            self._rids[request_id] = rid
        else:
            self._rids.pop(request_id, None)
            if not self._rids:
                self.busy_s += now - self._busy_since
        self.occupancy.append((time.time(), len(self._rids)))

    def _output(self, request_id: str, reply: dict) -> GenerateOutput:
        meta, ids = reply["meta_info"], list(reply["output_ids"])
        logprobs = [lp for lp, _, *_ in meta.get("output_token_logprobs") or []]
        if len(logprobs) != len(ids):
            raise ServerError(f"{self.url}/generate: {len(ids)} output ids but {len(logprobs)} logprobs")
        reason = (meta.get("finish_reason") or {}).get("type")
        if reason not in FINISH:
            raise ServerError(f"{self.url}/generate: unknown finish_reason {meta.get('finish_reason')!r}")
        cached = int(meta.get("cached_tokens") or 0)
        self.num_generated_tokens += len(ids)
        self.num_prefill_tokens += int(meta.get("prompt_tokens", 0)) - cached
        self.num_reused_tokens += cached
        return GenerateOutput(request_id, ids, logprobs, self._versions(meta, len(ids)), FINISH[reason], cached)

    def _versions(self, meta: dict, n: int) -> list[int]:
        spans = meta.get("weight_versions")
        if not spans:  # a server that reports only the version it serves now
            return [int(meta.get("weight_version", self.version))] * n
        versions = [self.version] * n
        for span in spans:
            versions[span["start"]:span["end"]] = [int(span["version"])] * (min(span["end"], n) - span["start"])
        return versions

    async def _abort_until_gone(self, match, everything: bool = False) -> None:
        """Abort, by rid, our requests in flight that `match(request_id, rid)`, until none is left (each
        round looks again: one that reached the server after its abort is caught by the next);
        `everything`: SGLang's `abort_all` first."""
        if everything:
            await self.request("POST", "/abort_request", {"rid": "", "abort_all": True})
        def left() -> list[str]:
            return [rid for request_id, rid in self._rids.items() if match(request_id, rid)]

        for attempt in range(self.abort_retries + 1):
            if not left():
                return
            if attempt or not everything:
                await asyncio.gather(*[self.request("POST", "/abort_request", {"rid": rid}) for rid in left()])
            await asyncio.sleep(self.abort_interval_s * min(attempt + 1, 10))
        if left():
            log.warning("%s: %d requests still in flight after %d aborts", self.url, len(left()), self.abort_retries)

    # -- control: the HTTP half of weight sync, pause, memory -----------------------------------------
    async def health(self) -> None:
        await self.request("GET", "/health")

    async def model_info(self) -> dict:
        return await self.request("GET", "/model_info")

    async def pause_generation(self, mode: str = "abort") -> None:
        await self.request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> None:
        await self.request("POST", "/continue_generation", {})

    async def begin_weight_update(self) -> None:
        """Open a weight-update session: SGLang loads tensor and distributed updates only inside one."""
        await self.request("POST", "/begin_weight_update", {"selector": "all"})

    async def end_weight_update(self) -> None:
        await self.request("POST", "/end_weight_update", {})

    async def flush_cache(self) -> bool:
        """False when the server refuses (requests are pending)."""
        return await self.request("POST", "/flush_cache", {}, ok_400=True) is not None

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self.request("POST", "/release_memory_occupation", {"tags": tags})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        await self.request("POST", "/resume_memory_occupation", {"tags": tags})

    async def update_weight_version(self, version: int, abort_all_requests: bool = False) -> None:
        await self.request("POST", "/update_weight_version",
                           {"new_version": str(version), "abort_all_requests": abort_all_requests})
        self.version = version

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str) -> None:
        await self.request("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str, flush_cache: bool,
                                              weight_version: int | None = None) -> None:
        await self.request("POST", "/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "flush_cache": flush_cache, "weight_version": None if weight_version is None else str(weight_version)})

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self.request("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_tensor(self, payloads: list[str], flush_cache: bool,
                                         weight_version: int | None = None) -> None:
        await self.request("POST", "/update_weights_from_tensor", {
            "serialized_named_tensors": payloads, "flush_cache": flush_cache,
            "weight_version": None if weight_version is None else str(weight_version)})

    async def update_weights_from_disk(self, model_path: str, flush_cache: bool,
                                       weight_version: int | None = None) -> None:
        await self.request("POST", "/update_weights_from_disk", {
            "model_path": model_path, "flush_cache": flush_cache,
            "weight_version": None if weight_version is None else str(weight_version)})
