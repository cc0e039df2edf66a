"""The weight endpoints of our engine server (`http_server.Server`), with SGLang's request fields and its
{"success", "message"} replies (400 when not successful):

- `/init_weights_update_group` {master_address, master_port, rank_offset, world_size, group_name, backend}:
  join the learner's broadcast group as rank `rank_offset` (`process_groups.init_custom_process_group`).
- `/update_weights_from_distributed` {names, dtypes, shapes, group_name, flush_cache, abort_all_requests,
  weight_version}: receive one bucket broadcast by rank 0 and load it.
- `/destroy_weights_update_group` {group_name}.
- `/update_weights_from_tensor` {serialized_named_tensors, load_format, flush_cache, abort_all_requests,
  weight_version}: tensors handed over by handle (shared memory on CPU, CUDA IPC on GPU).
- `/update_weights_from_disk` {model_path, abort_all_requests, weight_version, flush_cache}: safetensors files,
  from the model's own directory or under `--weights-root` only, each file confined there after its links
  are resolved (`read_confined`).
- `/update_weight_version` {new_version, abort_all_requests}.
- `/get_weights_by_name` {name, truncate_size}: the parameter's first `truncate_size` rows (100 by default) as
  nested lists of float32 values, SGLang's way to read back what a server serves (a POST here).
- `/begin_weight_update` {selector}, `/end_weight_update`: a weight-update session. As in SGLang, distributed
  and tensor updates are refused outside one (disk updates are not), and a session is opened only once.
  A session that no admin call renews for the lease (`--lease-s`) ends by itself.

An update is all or nothing. Where SGLang loads each bucket of a session as it comes, here each is checked
(names, shapes, every value finite) and staged (`weight_sync.StagedUpdate`), and the bucket that names the
new `weight_version` (our senders put it on the last one) loads them all at once; a refused bucket drops
the whole update, and a session that ends before its versioned bucket (its sender failed) drops what it
staged. A disk update is checked whole before it loads. Either way a refused update names the tensor, and
the model keeps the weights and version it had, bit for bit.

Blocking work (the rendezvous, the broadcast) runs in a thread, so the server keeps answering (aborts,
health) meanwhile; loading into the model runs on the event loop, between engine steps.
"""
from __future__ import annotations

import asyncio
import os
import pickle
import stat
from pathlib import Path

import torch
from aiohttp import web

from april_ray.engine import weight_sync
from april_ray.process_groups import destroy_group, init_custom_process_group


class Lease:
    """Ends what a client opened (a pause, a weight-update session) once no admin call has come for
    `seconds`: a client that went away, or a stray call, cannot hold generation or block the next update."""

    def __init__(self, seconds: float, end, what: str):
        self.seconds, self.end, self.what = seconds, end, what
        self.handle: asyncio.TimerHandle | None = None

    def renew(self) -> None:
        self.cancel()
        self.handle = asyncio.get_running_loop().call_later(self.seconds, self._expire)

    def touch(self) -> None:
        if self.handle is not None:
            self.renew()

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def _expire(self) -> None:
        self.handle = None
        print(f"{self.what} ended: no admin call for {self.seconds:.0f}s", flush=True)
        self.end()


class WeightRoutes:
    """Mixed into `http_server.Server`, which provides `core`, `exclusive`, `set_version`, `abort_call`."""

    def __init__(self, weights_root: str = "", lease_s: float = 300.0):
        self.groups: dict = {}
        self.session: str | None = None
        """The open weight-update session's selector (None: no session)."""
        self.staged: weight_sync.StagedUpdate | None = None
        """The buckets of the session's update so far, not loaded yet."""
        self.session_lease = Lease(lease_s, self._end_session, "weight-update session")
        self.disk_roots = [Path(self.model_path).resolve()] + ([Path(weights_root).resolve()] if weights_root else [])
        """Where /update_weights_from_disk may read: the model's directory, and the configured root."""

    def weight_routes(self) -> dict:
        handlers = {
            "/init_weights_update_group": self.init_group, "/destroy_weights_update_group": self.destroy_group,
            "/update_weights_from_distributed": self.from_distributed, "/update_weights_from_tensor": self.from_tensor,
            "/update_weights_from_disk": self.from_disk, "/update_weight_version": self.update_version,
            "/begin_weight_update": self.begin_update, "/end_weight_update": self.end_update,
        }
        return {path: _reply(fn) for path, fn in handlers.items()} | {
            "/get_weights_by_name": _reply(self.weights_by_name, wrap=False)}

    @property
    def device(self):
        return self.core.runner.device

    async def init_group(self, body: dict) -> str:
        name = body.get("group_name") or weight_sync.DEFAULT_GROUP
        if name in self.groups:
            raise ValueError(f"group {name!r} already exists")
        args = (body.get("backend") or "nccl", body["master_address"], int(body["master_port"]),
                int(body["rank_offset"]), int(body["world_size"]), name)
        pg = await asyncio.to_thread(init_custom_process_group, *args)
        self.groups[name] = (pg, weight_sync.comm_device(args[0], self.device))
        return f"Succeeded to initialize custom process group {name} as rank {body['rank_offset']}."

    async def destroy_group(self, body: dict) -> str:
        name = body.get("group_name") or weight_sync.DEFAULT_GROUP
        if name not in self.groups:
            raise ValueError(f"The group {name!r} to be destroyed does not exist.")
        destroy_group(self.groups.pop(name)[0])
        return "Succeeded to destroy custom process group."

    async def begin_update(self, body: dict) -> str:
        selector = body.get("selector") or "all"
        if selector not in ("target", "all"):
            raise ValueError(f"selector={selector!r} is not supported (this server has no draft model)")
        if self.session is not None:
            raise ValueError("a weight-update session is already open; call end_weight_update() first")
        self.session = selector
        self.staged = weight_sync.StagedUpdate(self.core.runner.model)
        self.session_lease.renew()
        return "Success"

    async def end_update(self, body: dict) -> str:
        if self.session is None:
            raise ValueError("no weight-update session is open; call begin_weight_update() first")
        dropped = self._end_session()
        return f"Success (dropped {dropped} staged tensors: no bucket named the update's weight_version)" \
            if dropped else "Success"

    def _end_session(self) -> int:
        """Close the session, dropping any update it did not finish; returns how many tensors that held."""
        self.session_lease.cancel()
        dropped = len(self.staged.tensors) if self.staged is not None else 0
        self.session, self.staged = None, None
        return dropped

    def _in_session(self, what: str) -> None:
        if self.session is None:
            raise ValueError(f"{what} must run between begin_weight_update() and end_weight_update()")

    async def from_distributed(self, body: dict) -> str:
        self._in_session("update_weights_from_distributed")
        name = body.get("group_name") or weight_sync.DEFAULT_GROUP
        if name not in self.groups:
            raise ValueError(f"group {name!r} does not exist: call /init_weights_update_group first")
        if body.get("load_format") not in (None, "direct"):
            raise ValueError(f"load_format={body['load_format']!r} is not supported (only the default)")
        meta = weight_sync.Bucket(body["names"], body["dtypes"], body["shapes"])
        staged, (pg, comm_device) = self.staged, self.groups[name]
        named = await asyncio.to_thread(weight_sync.receive_bucket, pg, meta, comm_device)
        await self._stage(staged, named, body, copy=False)  # received into fresh memory: kept as it is
        return f"Succeeded to update {len(named)} parameters online."

    async def from_tensor(self, body: dict) -> str:
        self._in_session("update_weights_from_tensor")
        payloads = body["serialized_named_tensors"]
        if body.get("load_format") not in (None, "direct"):
            raise ValueError(f"load_format={body['load_format']!r} is not supported (only the default)")
        if not isinstance(payloads, list) or len(payloads) != 1:
            raise ValueError("serialized_named_tensors must hold one payload (this server has one TP rank)")
        named = weight_sync.deserialize_named_tensors(payloads[0])
        await self._stage(self.staged, named, body, copy=True)  # the sender's memory: copied before we answer
        return "Success"

    async def from_disk(self, body: dict) -> str:
        path = Path(_text(body, "model_path")).resolve()
        if not _inside(path, self.disk_roots):
            raise ValueError(f"model_path {body['model_path']!r} is outside the directories this server loads "
                             f"from: {', '.join(map(str, self.disk_roots))} (--weights-root)")
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"model_path {body['model_path']!r}: no *.safetensors file there")
        staged = weight_sync.StagedUpdate(self.core.runner.model)
        staged.add([(n, t) for f in files for n, t in _safetensors(read_confined(f, self.disk_roots), f)], copy=False)
        async with self.exclusive(bool(body.get("abort_all_requests"))):  # checked first: a bad file never pauses
            staged.apply()
            self._updated(body)
        return f"Succeeded to update model weights from {body['model_path']}."

    async def update_version(self, body: dict) -> str:
        if body.get("abort_all_requests", True):
            for call in list(self.calls.values()):
                self.abort_call(call)
        self.set_version(str(body["new_version"]))
        return f"Weight version updated to {body['new_version']}"

    async def weights_by_name(self, body: dict) -> list:
        params = self.core.runner.model.state_dict(keep_vars=True)
        name = _text(body, "name")
        if name not in params:
            raise ValueError(f"weight {name!r} is not a parameter of the served model")
        return params[name].detach()[:int(body.get("truncate_size", 100))].to("cpu", torch.float32).tolist()

    async def _stage(self, staged: weight_sync.StagedUpdate, named: list, body: dict, copy: bool) -> None:
        """Stage one bucket of the session's update; the bucket that names the weight_version loads the whole
        update, under that version (a later update in the same session stages afresh)."""
        staged.add(named, copy)
        if body.get("weight_version") is None:
            return
        if staged is self.staged:
            self.staged = weight_sync.StagedUpdate(self.core.runner.model)
        async with self.exclusive(bool(body.get("abort_all_requests"))):
            staged.apply()
            self._updated(body)

    def _updated(self, body: dict) -> None:
        if body.get("flush_cache", True):
            self.core.flush_cache()
        if body.get("weight_version") is not None:
            self.set_version(str(body["weight_version"]))


def _text(body: dict, key: str) -> str:
    if not isinstance(body[key], str):
        raise ValueError(f"{key} must be a string, got {type(body[key]).__name__}")
    return body[key]


def _inside(path: Path, roots: list[Path]) -> bool:
    return any(path == root or root in path.parents for root in roots)


def read_confined(path: Path, roots: list[Path]) -> bytes:
    """The bytes of a regular file whose real path (links resolved) is under one of `roots`. What was
    opened is checked again through the descriptor, so a link swapped in after the first check is refused
    too; a FIFO or a device is refused without blocking on it."""
    real = path.resolve()
    if not _inside(real, roots):
        raise ValueError(f"model_path: {path.name} resolves to {real}, outside the directories this server loads "
                         f"from (--weights-root)")
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"model_path: {path.name} cannot be opened ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        opened = Path(os.readlink(f"/proc/self/fd/{fd}")) if os.path.exists(f"/proc/self/fd/{fd}") else real
        if not _inside(opened, roots) or not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"model_path: {path.name} is not a regular file under the directories this server "
                             f"loads from (--weights-root)")
        return f.read()


def _safetensors(data: bytes, path: Path) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load

    try:
        return list(load(data).items())
    except Exception as e:  # safetensors' own error type is not importable under a stable name
        raise ValueError(f"model_path: {path.name} is not a readable safetensors file ({e})") from None


def _reply(fn, wrap: bool = True):
    """SGLang's weight replies: {"success", "message"} (`wrap=False`: what `fn` returns, as JSON); a missing
    field or a refused update is a 400."""
    async def handler(request: web.Request) -> web.Response:
        try:
            body = await request.json() if request.body_exists else {}
            if not isinstance(body, dict):
                raise ValueError(f"the body must be a JSON object, got {type(body).__name__}")
            message = await fn(body)
        except (KeyError, TypeError, ValueError, RuntimeError, pickle.UnpicklingError) as e:
            detail = f"missing field {e}" if isinstance(e, KeyError) else str(e)
            return web.json_response({"success": False, "message": f"{request.path}: {detail}"}, status=400)
        return web.json_response({"success": True, "message": message} if wrap else message)
    return handler
