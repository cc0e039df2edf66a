"""The object-store channel: rank 0 puts the full weights in the object store once, and every engine adopts
them from that one object (an HTTP engine hands them on to its server from its own process)."""
from __future__ import annotations

from typing import Callable

import torch

from april_ray.types import Delivery


class ObjectStoreSender:
    def __init__(self, rank: int, put: Callable):
        self.rank, self.put = rank, put

    def send(self, named: list[tuple[str, torch.Tensor]], clients: list, version: int) -> Delivery:
        if self.rank != 0:
            return Delivery()
        return Delivery(weights=self.put({n: own_copy(t) for n, t in named}))


def own_copy(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of `t` holding its own bytes alone. A CPU learner's parameters can be views of one flat
    buffer (DeepSpeed's), and a view is serialised with its whole buffer, once per tensor: 46x the tiny
    model's weights in every publish."""
    return t.detach().to("cpu", copy=True)
