"""The tensor channel (colocated): each rank hands its weights by handle (CUDA IPC on a GPU, shared memory
on CPU) to the servers on its own devices, bucket by bucket (`engine.weight_handoff.send_tensors`, which
an HTTP engine also uses for what the object-store channel brought it): only handles cross HTTP."""
from __future__ import annotations

import asyncio

import torch

from april_ray.engine.weight_handoff import send_tensors
from april_ray.types import Delivery
from april_ray.weights.servers import send_to_each


class TensorSender:
    def __init__(self, rank: int, world_size: int, bucket_mb: float, flush_cache: bool):
        self.rank, self.world_size, self.bucket_mb, self.flush_cache = rank, world_size, bucket_mb, flush_cache

    def send(self, named: list[tuple[str, torch.Tensor]], clients: list, version: int) -> Delivery:
        """Engine i's server runs on rank i % world_size's devices (the colocated layout)."""
        mine = [c for c in clients[self.rank::self.world_size] if c is not None]
        return Delivery(loaded=tuple(asyncio.run(send_to_each(
            mine, lambda c: send_tensors(c, named, version, self.flush_cache, self.bucket_mb)))))
