"""The broadcast channel (disaggregated): the learner's rank 0 and every server (ranks `rank_offset...`)
form a process group of their own, the way SGLang's `init_weights_update_group` builds it
(`process_groups.init_custom_process_group`), so the learner's own group is untouched. Metadata (names,
dtypes, shapes) travels over HTTP, one request per bucket; the tensors by `broadcast` from rank 0. The
same code runs gloo on CPU and NCCL on GPU: only the backend name and the tensors' device differ."""
from __future__ import annotations

import asyncio
import logging
import uuid
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from april_ray.engine.base import BadRequestError
from april_ray.engine.weight_handoff import raise_first, weight_update
from april_ray.engine.weight_sync import DEFAULT_GROUP, bucket_meta, buckets, comm_device
from april_ray.process_groups import destroy_group, free_port, init_custom_process_group
from april_ray.types import Delivery
from april_ray.weights.servers import answers

log = logging.getLogger(__name__)


class BroadcastSender:
    """Rank 0 broadcasts into every server that answers; the other ranks only took part in gathering."""

    def __init__(self, rank: int, node_address: str, backend: str, bucket_mb: float, tp_size: int,
                 flush_cache: bool):
        self.rank, self.node_address, self.flush_cache = rank, node_address, flush_cache
        self.backend, self.bucket_mb, self.tp_size = backend, bucket_mb, tp_size
        self.group: BroadcastGroup | None = None

    def send(self, named: list[tuple[str, torch.Tensor]], clients: list, version: int) -> Delivery:
        live = [c for c in clients if c is not None]
        if self.rank != 0 or not live:
            return Delivery()
        if self.group is None:
            self.group = BroadcastGroup(self.master_address([c.url for c in live]), self.backend, self.bucket_mb,
                                        self.tp_size, group_prefix=f"april-weights-{uuid.uuid4().hex[:8]}")
        return Delivery(loaded=tuple(asyncio.run(self.group.send(live, named, version, self.flush_cache))))

    def master_address(self, urls: list[str]) -> str:
        """Where the servers reach rank 0's rendezvous: loopback when they all run on this node's loopback."""
        local = all(urlparse(u).hostname in ("127.0.0.1", "localhost", "::1") for u in urls)
        return "127.0.0.1" if local else self.node_address


class BroadcastGroup:
    """Rank 0's end of one group with every server that answers (each server's TP ranks follow
    `rank_offset`), metadata of each bucket over HTTP, its tensors by broadcast. Servers are paused in place
    around an update, so no request samples from half-updated weights.

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
        weights (none after `attempts` failed updates). A server's refusal (400: a tensor holds a NaN,
        which every server refuses alike) raises `BadRequestError` naming the tensor; a server that refuses
        drops the whole update."""
        try:
            for _ in range(attempts):
                live = [c for c, ok in zip(clients, await asyncio.gather(*[answers(c) for c in clients])) if ok]
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
                except BadRequestError:  # a server refused the weights (one holds a NaN): none loaded them
                    raise
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
                error = await asyncio.to_thread(broadcast_bucket, self.pg, bucket, device)
                if error is not None:  # a server died: the others wait for tensors that will not come
                    self._drop_local()
                    await posts
                    raise RuntimeError(error)
                raise_first(await posts)

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


def broadcast_bucket(pg, bucket: list[tuple[str, torch.Tensor]], device: torch.device) -> str | None:
    """Sender side of one bucket: rank 0 broadcasts each tensor, in order, as the receivers expect. Returns
    the error of a failed broadcast as text: the exception's traceback would hold the failed work, and
    through it the group's connections, open, and the surviving receivers would wait out the group's
    timeout instead of failing when the group is destroyed."""
    try:
        for _, t in bucket:
            dist.broadcast(t.detach().to(device).contiguous(), src=0, group=pg)
    except RuntimeError as e:  # gloo's error on a peer that died; NCCL's on a broken communicator
        return str(e)
    return None
