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


def check_named_tensors(params: dict[str, torch.Tensor], named: list[tuple[str, torch.Tensor]]) -> None:
    """Every tensor a parameter or buffer of the model (`params`: its state dict) by name, of its shape,
    and finite; a ValueError names the first that is not."""
    for name, t in named:
        if name not in params:
            raise ValueError(f"weight {name!r} is not a parameter of the served model")
        if tuple(params[name].shape) != tuple(t.shape):
            raise ValueError(f"weight {name!r}: shape {tuple(t.shape)} does not match the model's "
                             f"{tuple(params[name].shape)}")
    refuse_non_finite(named)


def refuse_non_finite(named: list[tuple[str, torch.Tensor]]) -> None:
    """A NaN or an infinity in any floating tensor refuses the whole update, naming the tensor (one check
    per tensor, all read back at once)."""
    floats = [(n, t) for n, t in named if t.is_floating_point() or t.is_complex()]
    if not floats:
        return
    finite = torch.stack([torch.isfinite(t).all() for _, t in floats]).tolist()
    bad = [n for (n, _), ok in zip(floats, finite) if not ok]
    if bad:
        more = f" (and {len(bad) - 1} more: {', '.join(bad[1:4])}{', ...' if len(bad) > 4 else ''})" if bad[1:] else ""
        raise ValueError(f"weight {bad[0]!r} holds NaN or infinite values{more}: refused, the served weights are "
                         f"unchanged")


def check_full_update(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """A whole model's weights (the object-store channel's), checked before any is copied: every tensor of
    the model's given (a tied head by the embedding alone, as learn/optim.served_names sends it), none
    else, each of its shape and finite."""
    params = model.state_dict(keep_vars=True)
    given = [params[k] for k in state_dict if k in params]
    missing = [n for n in params if n not in state_dict and not any(params[n] is g for g in given)]
    unexpected = [n for n in state_dict if n not in params]
    if missing or unexpected:
        raise ValueError(f"weights do not match the engine's model (missing {missing}, unexpected {unexpected})")
    check_named_tensors(params, list(state_dict.items()))


class StagedUpdate:
    """The buckets of one update in a weight-update session, each checked as it arrives
    (`check_named_tensors`) and held until `apply` copies them all into the model at once, so the model
    never serves part of an update: a refused bucket drops the whole update and refuses the rest of it.

    Memory: one copy of what the update carries (the whole model, for a full update) in host memory,
    besides the model; on a GPU the device holds no more than the bucket being received, at the price of
    a copy to the host per bucket and one back at `apply`. Staging on the device instead would need room
    for the model twice (Qwen3-4B: 8 GB more in bf16), which a colocated server may not have."""

    def __init__(self, model: torch.nn.Module):
        self.params = model.state_dict(keep_vars=True)
        self.tensors: dict[str, torch.Tensor] = {}
        self.refused = ""
        """Why a bucket of this update was refused ("": none was)."""

    def add(self, named: list[tuple[str, torch.Tensor]], copy: bool) -> None:
        """Check one bucket and keep it (`copy`: the tensors are the sender's, handed over by handle, and
        stay its own; else received into fresh memory that the stage can keep as it is)."""
        if self.refused:
            raise ValueError(f"an earlier bucket of this update was refused ({self.refused})")
        try:
            check_named_tensors(self.params, named)
        except ValueError as e:
            self.refused = str(e)
            self.tensors.clear()
            raise
        for name, t in named:
            self.tensors[name] = t.to("cpu", copy=copy)

    def apply(self) -> int:
        """Copy every staged tensor into the model; returns how many there were."""
        with torch.no_grad():
            for name, t in self.tensors.items():
                self.params[name].data.copy_(t)
        return len(self.tensors)
