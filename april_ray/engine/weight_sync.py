"""Moving weights from a learner into inference servers, both ends: by broadcast and by tensor handoff.

**Broadcast** (disaggregated layouts). The learner's rank 0 (rank 0) and every server (ranks
`rank_offset...`) form a process group of their own, the way SGLang's `init_weights_update_group` builds
it (`init_custom_process_group`: a TCP rendezvous under a prefix of the group's name, a process group
that is never the default one), so the learner's own DeepSpeed group is untouched. Metadata (names,
dtypes, shapes) travels over HTTP, one request per bucket; the tensors travel by `broadcast` from rank 0.
The same code runs gloo on CPU and NCCL on GPU: only the backend name and the tensors' device differ.

**Tensor handoff** (colocated layouts). The learner serializes `(name, tensor)` pairs with torch's
multiprocessing reductions, as SGLang's `MultiprocessingSerializer` does: a CUDA tensor becomes a CUDA IPC
handle, a CPU tensor a shared-memory file name, so only handles cross HTTP (base64, in
`serialized_named_tensors`). The receiver unpickles with an allow-list of torch's rebuild functions and
plain containers, nothing else.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import logging
import pickle
import shutil
import uuid
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from april_ray.engine.sglang_client import BadRequestError
from april_ray.engine.sglang_server import free_port


DEFAULT_GROUP = "weight_update_group"
log = logging.getLogger(__name__)


def init_custom_process_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
                              group_name: str, timeout_s: float = 300.0):
    """A process group of its own (never the default one): rendezvous on master_address:master_port,
    where rank 0 hosts the store. Mirrors SGLang's `init_custom_process_group`, so a learner built on it
    broadcasts into a real SGLang server, and our server receives from a learner that uses SGLang's."""
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world

    timeout = timedelta(seconds=timeout_s)
    store = PrefixStore(group_name, tcp_store(master_address, master_port, world_size, rank == 0, timeout))
    pg, _ = _new_process_group_helper(world_size, rank, [], dist.Backend(backend), store,
                                      group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def tcp_store(address: str, port: int, world_size: int, is_master: bool, timeout: timedelta) -> dist.TCPStore:
    """A TCPStore whose server (on the master) listens on `address` only: left to itself it listens on every
    interface (::) whatever address it is given; handed a socket bound to the address
    (`master_listen_fd`), it listens there (127.0.0.1 on one node; tests/test_listeners.py)."""
    import socket

    if not is_master:
        return dist.TCPStore(address, port, world_size, False, timeout)
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, port))
    sock.listen()
    store = dist.TCPStore(address, port, world_size, True, timeout, master_listen_fd=sock.fileno())
    sock.detach()  # the store's server owns the descriptor now
    return store


def destroy_group(pg) -> None:
    dist.destroy_process_group(pg)


def comm_device(backend: str, device: torch.device | str) -> torch.device:
    """Where a broadcast's tensors must live: gloo moves CPU tensors, NCCL GPU ones."""
    return torch.device("cpu") if backend == "gloo" else torch.device(device)


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's wire name of a dtype: 'bfloat16', 'float32' (its receiver calls getattr(torch, name))."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


@dataclass
class Bucket:
    """One `/update_weights_from_distributed` request: the metadata of the tensors broadcast after it."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]


def buckets(named: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of tensors of at most `bucket_bytes` each (a larger tensor goes alone)."""
    out: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if not out or size + n > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += n
    return out


def bucket_meta(bucket: list[tuple[str, torch.Tensor]]) -> Bucket:
    return Bucket([n for n, _ in bucket], [dtype_name(t.dtype) for _, t in bucket],
                  [list(t.shape) for _, t in bucket])


def broadcast_bucket(pg, bucket: list[tuple[str, torch.Tensor]], device: torch.device) -> None:
    """Sender side of one bucket: rank 0 broadcasts each tensor, in order, as the receivers expect."""
    for _, t in bucket:
        dist.broadcast(t.detach().to(device).contiguous(), src=0, group=pg)


def receive_bucket(pg, meta: Bucket, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """Receiver side of one bucket: empty tensors of the announced dtypes and shapes, filled by rank 0."""
    if not len(meta.names) == len(meta.dtypes) == len(meta.shapes):
        raise ValueError(f"names, dtypes and shapes differ in length: {len(meta.names)}, {len(meta.dtypes)}, "
                         f"{len(meta.shapes)}")
    out = []
    for name, dt, shape in zip(meta.names, meta.dtypes, meta.shapes):
        t = torch.empty(shape, dtype=parse_dtype(dt), device=device)
        dist.broadcast(t, src=0, group=pg)
        out.append((name, t))
    return out


# -- tensor handoff -------------------------------------------------------------------------------------

@contextlib.contextmanager
def _file_system_sharing():
    """CPU storages shared by file name: a file descriptor (torch's default strategy) can only be passed to
    a child that shares our authkey, and the server is an unrelated process."""
    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        mp.set_sharing_strategy(before)


def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> tuple[str, list[torch.Tensor]]:
    """(base64 payload for one TP rank's `serialized_named_tensors`, the tensors it points to). The
    caller keeps the tensors alive until the server has answered: the payload holds handles, not data.
    CPU tensors are copied into shared memory first, so the learner's own parameters never move."""
    shared = [(n, t.detach() if t.is_cuda else t.detach().clone()) for n, t in named]
    buf = io.BytesIO()
    with _file_system_sharing():
        ForkingPickler(buf).dump(shared)
    return base64.b64encode(buf.getvalue()).decode("ascii"), [t for _, t in shared]


_ALLOWED = {
    ("builtins", name) for name in ("list", "tuple", "dict", "int", "float", "str", "bool", "bytes")
} | {
    ("collections", "OrderedDict"),
    ("torch", "Size"), ("torch", "device"), ("torch", "Tensor"), ("torch", "UntypedStorage"),
    ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
    ("torch.nn.parameter", "Parameter"),
    ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter"),
    ("torch._tensor", "_rebuild_from_type_v2"),
} | {
    ("torch.multiprocessing.reductions", name) for name in (
        "rebuild_tensor", "rebuild_cuda_tensor", "rebuild_typed_storage", "rebuild_typed_storage_child",
        "rebuild_storage_filename", "rebuild_storage_empty", "rebuild_meta_tensor")
}


class _TensorUnpickler(pickle.Unpickler):
    """Only torch's tensor-rebuilding functions, dtypes and plain containers: a payload is handles to
    tensors, and anything else in it is refused (an HTTP body must never run code)."""

    def find_class(self, module, name):
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"serialized_named_tensors: {module}.{name} is not allowed in a tensor payload")


def deserialize_named_tensors(payload: str | bytes) -> list[tuple[str, torch.Tensor]]:
    raw = base64.b64decode(payload, validate=True) if isinstance(payload, str) else bytes(payload)
    named = _TensorUnpickler(io.BytesIO(raw)).load()
    if not isinstance(named, list) or not all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
            for p in named):
        raise ValueError("serialized_named_tensors: expected a list of (name, tensor) pairs")
    return named


def load_named_tensors(model: torch.nn.Module, named: list[tuple[str, torch.Tensor]]) -> None:
    """Copy tensors into the model's parameters and buffers by state-dict name, in place (any subset: a
    bucket carries part of the model). An unknown name or a wrong shape fails before anything is copied."""
    targets = model.state_dict(keep_vars=True)
    for name, t in named:
        if name not in targets:
            raise ValueError(f"weight {name!r} is not a parameter of the served model")
        if tuple(targets[name].shape) != tuple(t.shape):
            raise ValueError(f"weight {name!r}: shape {tuple(t.shape)} does not match the model's "
                             f"{tuple(targets[name].shape)}")
    with torch.no_grad():
        for name, t in named:
            targets[name].data.copy_(t)


# -- the learner's side, over the servers' HTTP clients (`sglang_client.SGLangEngine`) ---------------------

class BroadcastSender:
    """Learner rank 0's end of the broadcast: one group with every server that answers (each server's TP
    ranks follow `rank_offset`), metadata of each bucket over HTTP, its tensors by broadcast. Servers are
    paused in place around an update, so no request samples from half-updated weights.

    A server that does not answer, or fails mid-update (its engine died), is left out: the driver catches
    its engine up from the object store once it is back. The group is rebuilt, under a fresh name, whenever
    its members change, which takes a restarted engine's new server in at the next update."""

    def __init__(self, master_address: str, backend: str, bucket_mb: float, tp_size: int = 1,
                 group_prefix: str = DEFAULT_GROUP, timeout_s: float = 300.0):
        self.master_address, self.backend = master_address, backend
        self.bucket_bytes = int(bucket_mb * (1 << 20))
        self.tp_size, self.group_prefix, self.timeout_s = tp_size, group_prefix, timeout_s
        self.clients: list = []
        """The group's members (besides rank 0)."""
        self.group_name = ""
        self.pg = None

    @property
    def urls(self) -> list[str]:
        return [c.url for c in self.clients]

    async def send(self, clients, named: list[tuple[str, torch.Tensor]], version: int, flush_cache: bool,
                   attempts: int = 2) -> list[str]:
        """Broadcast into every server of `clients` that answers; returns the URLs of those that loaded the
        weights (none after `attempts` failed updates)."""
        try:
            for _ in range(attempts):
                answers = await asyncio.gather(*[_answers(c) for c in clients])
                live = [c for c, ok in zip(clients, answers) if ok]
                if not live:
                    await self.close()
                    return []
                try:
                    if [c.url for c in live] != self.urls or self.pg is None:
                        await self.close()
                        self.clients = live
                        await self.connect()
                    await self._send(named, version, flush_cache)
                    return self.urls
                except RuntimeError as e:  # ServerError, ServerDied, gloo's error on a peer that died
                    log.warning("weight broadcast to %s failed (%s: %s); regrouping with the servers that answer",
                                self.urls, type(e).__name__, str(e)[:300])
                    self._drop_local()
            return []
        finally:
            await asyncio.gather(*[c.close() for c in {*clients, *self.clients}])  # this event loop's sessions

    async def connect(self) -> None:
        self.group_name = f"{self.group_prefix}-{uuid.uuid4().hex[:8]}"
        port, world = free_port(self.master_address), 1 + len(self.clients) * self.tp_size
        joins = asyncio.gather(*[c.init_weights_update_group(self.master_address, port, 1 + i * self.tp_size, world,
                                                             self.group_name, self.backend)
                                 for i, c in enumerate(self.clients)])
        self.pg = await asyncio.to_thread(init_custom_process_group, self.backend, self.master_address, port, 0,
                                          world, self.group_name, self.timeout_s)
        await joins

    async def _send(self, named: list[tuple[str, torch.Tensor]], version: int, flush_cache: bool) -> None:
        device = comm_device(self.backend, "cuda")
        async with weight_update(self.clients):
            parts = buckets(named, self.bucket_bytes)
            for i, bucket in enumerate(parts):
                meta = bucket_meta(bucket)
                last = version if i == len(parts) - 1 else None
                posts = asyncio.gather(*[c.update_weights_from_distributed(meta.names, meta.dtypes, meta.shapes,
                                                                           self.group_name, flush_cache, last)
                                         for c in self.clients], return_exceptions=True)
                try:
                    await asyncio.to_thread(broadcast_bucket, self.pg, bucket, device)
                except RuntimeError:  # a server died: the others wait for tensors that will not come
                    self._drop_local()
                    await posts
                    raise
                _raise_first(await posts)

    def _drop_local(self) -> None:
        """Leave the group on this side at once: the survivors' pending receives fail instead of waiting."""
        if self.pg is not None:
            destroy_group(self.pg)
            self.pg = None

    async def close(self) -> None:
        """Leave the group; servers that are gone (a restarted engine's old one) are skipped."""
        if self.clients:
            await asyncio.gather(*[c.destroy_weights_update_group(self.group_name) for c in self.clients],
                                 return_exceptions=True)
            await asyncio.gather(*[c.close() for c in self.clients])
        self._drop_local()
        self.clients = []


async def _answers(client, timeout_s: float = 10.0) -> bool:
    try:
        await asyncio.wait_for(client.health(), timeout_s)
        return True
    except (RuntimeError, asyncio.TimeoutError):
        return False


async def send_to_each(clients, send_one) -> list[str]:
    """`send_one(client)` for every client at once; returns the URLs of those it succeeded for. A server that
    fails (its engine died or is restarting) is left out, to be caught up once back."""
    async def one(client) -> bool:
        try:
            await send_one(client)
            return True
        except RuntimeError as e:  # ServerError, ServerDied; a refused update (400) is a bug, raised
            if isinstance(e, BadRequestError):
                raise
            log.warning("weights to %s failed (%s: %s): left out", client.url, type(e).__name__, str(e)[:300])
            return False
        finally:
            await client.close()
    done = await asyncio.gather(*[one(c) for c in clients])
    return [c.url for c, ok in zip(clients, done) if ok]


async def send_tensors(client, named: list[tuple[str, torch.Tensor]], version: int, flush_cache: bool,
                       bucket_mb: float, tp_size: int = 1) -> None:
    """Colocated: hand this learner's tensors to the server on its own GPU (or CPU), bucket by bucket;
    each bucket's tensors stay referenced until the server has loaded them."""
    async with weight_update([client]):
        parts = buckets(named, int(bucket_mb * (1 << 20)))
        for i, bucket in enumerate(parts):
            payload, keep = serialize_named_tensors(bucket)
            await client.update_weights_from_tensor([payload] * tp_size, flush_cache,
                                                    version if i == len(parts) - 1 else None)
            del keep


@contextlib.asynccontextmanager
async def weight_update(clients):
    """The servers paused in place (no request samples from half-updated weights) and inside a
    weight-update session (SGLang refuses tensor and distributed updates outside one) for the body. Every
    server that began a session ends it, and every server is told to continue, whatever happens (a pause or
    a begin that failed on one server, an error in the body): a server left paused holds every later
    request, one left in a session refuses the next begin. The first error goes on up."""
    async def on_all(call, among=clients) -> list:
        return await asyncio.gather(*[call(c) for c in among], return_exceptions=True)

    began: list = []
    try:
        _raise_first(await on_all(lambda c: c.pause_generation("in_place")))
        opened = await on_all(lambda c: c.begin_weight_update())
        began = [c for c, r in zip(clients, opened) if not isinstance(r, BaseException)]
        _raise_first(opened)
        yield
    except BaseException:
        await on_all(lambda c: c.end_weight_update(), began)
        await on_all(lambda c: c.continue_generation())
        raise
    _raise_first(await on_all(lambda c: c.end_weight_update(), began)
                 + await on_all(lambda c: c.continue_generation()))


def _raise_first(results: list) -> None:
    for r in results:
        if isinstance(r, BaseException):
            raise r


def save_for_disk_update(named: list[tuple[str, torch.Tensor]], out_dir: str, base_model_dir: str) -> None:
    """Write the weights as one safetensors file next to the base model's config files (a real SGLang
    server reads the config too). Tied tensors are written once, as safetensors requires."""
    from safetensors.torch import save_file

    out, seen, tensors = Path(out_dir), set(), {}
    out.mkdir(parents=True, exist_ok=True)
    for name, t in named:
        key = (t.data_ptr(), t.dtype, tuple(t.shape))
        if key not in seen:
            seen.add(key)
            tensors[name] = t.detach().to("cpu").contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    for f in Path(base_model_dir).glob("*.json"):
        if not f.name.endswith(".index.json"):
            shutil.copy(f, out / f.name)
