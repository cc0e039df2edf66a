"""Weight channels: how a learner rank's weights reach the engines (`engine.weight_sync`), one module per
channel, each a sender chosen once when the rank is built (`build_sender`), as its optimiser backend is.

- object_store: rank 0 puts the full weights in the object store once; the engines adopt that one object.
- broadcast: rank 0 broadcasts into every server through a process group of its own (disaggregated).
- tensor: each rank hands its weights by handle (CUDA IPC) to the servers on its own GPU (colocated).
- disk: rank 0 writes a safetensors directory that every server loads.

Every rank enters `send` (a ZeRO-3 rank must take part in gathering); each returns a `Delivery`: the
servers that loaded the weights, or the object-store handle. Adopting them is the engines' side
(driver/engines.py). The server's end of each channel is april_ray/engine/http_weights.py.

An update is all or nothing. Weights holding a NaN or an infinity leave no rank (`FiniteOnly`): SGLang
loads each bucket as it arrives and checks none, so only the sender can keep a server we do not control
from serving part of such an update. Our own engines check every update again, whole, before loading any
of it (`LLMEngine.update_weights`, `http_weights`), for whatever else sends to them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

from april_ray.types import Delivery

if TYPE_CHECKING:
    import torch


class WeightSender(Protocol):
    def send(self, named: list[tuple[str, torch.Tensor]], clients: list, version: int) -> Delivery:
        """Deliver this rank's full weights as `version`. `clients`: an `SGLangEngine` (admin key) per
        engine in engine order, None where the engine is down (the object-store channel gets none)."""


def build_sender(channel: str, rank: int, world_size: int, *, flush_cache: bool, bucket_mb: float,
                 backend: str = "gloo", tp_size: int = 1, node_address: str = "127.0.0.1",
                 disk_path: str = "", base_model_dir: str = "", put: Callable | None = None) -> WeightSender:
    """`flush_cache`: servers drop their prefix caches with an update. `backend`: the broadcast's (gloo with
    our CPU server, NCCL on GPUs). `node_address`: where servers on other nodes reach this rank. `disk_path`:
    the directory the disk channel writes (storage every node sees). `put`: the object store's put."""
    if channel == "object_store":
        from april_ray.weights.object_store import ObjectStoreSender
        sender = ObjectStoreSender(rank, put)
    elif channel == "broadcast":
        from april_ray.weights.broadcast import BroadcastSender
        sender = BroadcastSender(rank, node_address, backend, bucket_mb, tp_size, flush_cache)
    elif channel == "tensor":
        from april_ray.weights.tensor import TensorSender
        sender = TensorSender(rank, world_size, bucket_mb, flush_cache)
    elif channel == "disk":
        from april_ray.weights.disk import DiskSender
        sender = DiskSender(rank, disk_path, base_model_dir, flush_cache)
    else:
        raise ValueError(f"engine.weight_sync: unknown channel {channel!r}")
    return FiniteOnly(sender)


class FiniteOnly:
    """A sender that refuses weights holding a NaN or an infinity before any of them leaves the rank, with a
    ValueError naming the tensor (one `isfinite` pass per tensor: scratch of a byte per element of the
    largest)."""

    def __init__(self, sender: WeightSender):
        self.sender = sender

    def send(self, named: list[tuple[str, torch.Tensor]], clients: list, version: int) -> Delivery:
        from april_ray.engine.weight_sync import refuse_non_finite

        refuse_non_finite(named)
        return self.sender.send(named, clients, version)
