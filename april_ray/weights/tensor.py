"""The tensor channel (colocated): each rank hands its weights by handle (CUDA IPC on a GPU, shared memory
on CPU) to the servers on its own devices, bucket by bucket: only handles cross HTTP
(`weight_sync.serialize_named_tensors`). The object-store channel uses the same handoff from an HTTP
engine's own process (`SGLangEngine.update_weights`)."""
from __future__ import annotations

import asyncio

import torch

from april_ray.engine.weight_sync import buckets, serialize_named_tensors
from april_ray.types import Delivery
from april_ray.weights.servers import send_to_each, weight_update


class TensorSender:
    def __init__(self, rank: int, world_size: int, bucket_mb: float, flush_cache: bool):
        self.rank, self.world_size, self.bucket_mb, self.flush_cache = rank, world_size, bucket_mb, flush_cache

    def send(self, named: list[tuple[str, torch.Tensor]], clients: list, version: int) -> Delivery:
        """Engine i's server runs on rank i % world_size's devices (the colocated layout)."""
        mine = [c for c in clients[self.rank::self.world_size] if c is not None]
        return Delivery(loaded=tuple(asyncio.run(send_to_each(
            mine, lambda c: send_tensors(c, named, version, self.flush_cache, self.bucket_mb)))))


async def send_tensors(client, named: list[tuple[str, torch.Tensor]], version: int, flush_cache: bool,
                       bucket_mb: float, tp_size: int = 1) -> None:
    """Hand `named` to one server, bucket by bucket; each bucket's tensors stay referenced until the
    server has loaded them (the payload holds handles, not data)."""
    async with weight_update([client]):
        parts = buckets(named, int(bucket_mb * (1 << 20)))
        for i, bucket in enumerate(parts):
            payload, keep = serialize_named_tensors(bucket)
            await client.update_weights_from_tensor([payload] * tp_size, flush_cache,
                                                    version if i == len(parts) - 1 else None)
            del keep
