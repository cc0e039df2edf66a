"""The wire format of weight updates into inference servers, and the server's end of it (the senders,
one module per channel, are in april_ray/weights/).

**Broadcast**: the metadata of a bucket (names, dtypes, shapes) travels over HTTP, its tensors by
`broadcast` in a process group of the learner's rank 0 and the servers (april_ray/process_groups.py).

**Tensor handoff**: `(name, tensor)` pairs serialized with torch's multiprocessing reductions, as SGLang's
`MultiprocessingSerializer` does: a CUDA tensor becomes a CUDA IPC handle, a CPU tensor a shared-memory
file name, so only handles cross HTTP (base64, in `serialized_named_tensors`). The receiver unpickles with
an allow-list of torch's rebuild functions and plain containers, nothing else.
"""
from __future__ import annotations

import base64
import contextlib
import io
import pickle
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_GROUP = "weight_update_group"


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
