"""Optimiser state on disk without pickle: the tensors of a nested state (an optimiser's `state_dict`,
DeepSpeed's checkpoint files) in a safetensors file, the structure around them as JSON in the file's
metadata. Loading parses a safetensors header and JSON, never a pickle: a checkpoint cannot run code.

The structure may hold dicts (any of int, float, str, bool or None as keys), lists, tuples, sets,
`torch.Size`, numbers, strings, None, enums (kept as their value) and the few plain-data classes of
DeepSpeed's optimiser state in `CLASSES` (rebuilt from their attributes, no code of theirs run). Anything
else is refused when saving, naming where it sits in the state."""
from __future__ import annotations

import importlib
import json
from enum import Enum
from pathlib import Path

import torch

TREE = "april_ray_tree"
"""The metadata key holding the JSON structure."""


CLASSES = {"deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
           "deepspeed.utils.tensor_fragment.fragment_address"}
"""Classes a state may hold, by module and name: each is data in its attributes (a loss scale, a slice)."""


class StateFileError(ValueError):
    """A state file that is not ours (not safetensors, no structure, a bad tree); names the file."""


def save_state(state, path: str | Path) -> None:
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    tree = _encode(state, tensors, "state")
    save_file(tensors, str(path), metadata={TREE: json.dumps(tree)})


def load_state(path: str | Path):
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise StateFileError(f"{path}: not a safetensors state file ({e}); refused, never unpickled") from None
    if TREE not in meta:
        raise StateFileError(f"{path}: a safetensors file without april-ray's {TREE} metadata")
    try:
        return _decode(json.loads(meta[TREE]), tensors)
    except (ValueError, KeyError, TypeError) as e:
        raise StateFileError(f"{path}: {TREE} metadata is not a valid state tree ({e!r})") from None


SEQUENCES = (("list", list), ("tuple", tuple), ("set", set))


def _encode(obj, tensors: dict, where: str, storages: set | None = None):
    storages = set() if storages is None else storages
    if isinstance(obj, torch.Tensor):
        key = str(len(tensors))
        t = obj.detach().cpu().contiguous()
        # safetensors refuses tensors that share memory (views of one flat buffer): each gets its own copy
        if t.untyped_storage().data_ptr() in storages:
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        tensors[key] = t
        return {"tensor": key}
    if isinstance(obj, Enum):
        return _encode(obj.value, tensors, where)
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, dict):
        return {"dict": [[_key(k, where), _encode(v, tensors, f"{where}[{k!r}]", storages)] for k, v in obj.items()]}
    if isinstance(obj, torch.Size):
        return {"size": list(obj)}
    for kind, cls in SEQUENCES:
        if isinstance(obj, cls):
            return {kind: [_encode(v, tensors, f"{where}[{i}]", storages) for i, v in enumerate(obj)]}
    name = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if name in CLASSES:
        return {"object": [name, _encode(vars(obj), tensors, where, storages)]}
    raise TypeError(f"{where}: a {name} cannot be saved as tensors and JSON")


def _key(k, where: str):
    if isinstance(k, Enum):
        k = k.value
    if k is None or isinstance(k, (bool, int, float, str)):
        return k
    raise TypeError(f"{where}: a dict key of type {type(k).__qualname__} cannot be saved as JSON")


def _decode(node, tensors: dict):
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    (kind, value), = node.items()
    if kind == "tensor":
        return tensors[value]
    if kind == "dict":
        return {k: _decode(v, tensors) for k, v in value}
    if kind == "size":
        return torch.Size(value)
    if kind == "object":
        return _rebuild(*value, tensors)
    return dict(SEQUENCES)[kind](_decode(v, tensors) for v in value)


def deepspeed_checkpoint_engine():
    """DeepSpeed's checkpoint engine with its files (named `*.pt` by DeepSpeed) written by `save_state` and
    read by `load_state`: DeepSpeed's own engine unpickles them."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    class SafeCheckpointEngine(TorchCheckpointEngine):
        def save(self, state_dict, path: str) -> None:
            save_state(state_dict, path)

        def load(self, path: str, map_location=None):
            return load_state(path)

    return SafeCheckpointEngine()


def _rebuild(name: str, attrs, tensors: dict):
    """An instance of a class in `CLASSES` with these attributes, made without calling its code."""
    if name not in CLASSES:
        raise ValueError(f"class {name!r} is not one a state may hold")
    module, _, qualname = name.rpartition(".")
    cls = getattr(importlib.import_module(module), qualname)
    obj = object.__new__(cls)
    obj.__dict__.update(_decode(attrs, tensors))
    return obj
