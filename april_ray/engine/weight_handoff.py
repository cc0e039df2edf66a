"""A weight update as a client of SGLang's API runs it: the servers paused in place and inside a
weight-update session (`weight_update`), and tensors handed to one server by handle, bucket by bucket
(`send_tensors`: CUDA IPC on a GPU, shared memory on CPU; only handles cross HTTP). The tensor channel
(april_ray/weights/tensor.py) sends through it from a learner rank, and an HTTP engine through it from its
own process (`SGLangEngine.update_weights`), so it lives below both."""
from __future__ import annotations

import asyncio
import contextlib

import torch

from april_ray.engine.weight_sync import buckets, serialize_named_tensors


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
        raise_first(await on_all(lambda c: c.pause_generation("in_place")))
        opened = await on_all(lambda c: c.begin_weight_update())
        began = [c for c, r in zip(clients, opened) if not isinstance(r, BaseException)]
        raise_first(opened)
        yield
    except BaseException:
        await on_all(lambda c: c.end_weight_update(), began)
        await on_all(lambda c: c.continue_generation())
        raise
    raise_first(await on_all(lambda c: c.end_weight_update(), began)
                + await on_all(lambda c: c.continue_generation()))


def raise_first(results: list) -> None:
    for r in results:
        if isinstance(r, BaseException):
            raise r


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
