"""Learner actor: one data-parallel rank, a shell around `april_ray.learn.learner.Learner`.

It fetches its own share of the batch from the sample handles the driver hands it (no rank-0 funnel).
"""
from __future__ import annotations

import asyncio
import os
import socket
import uuid
from urllib.parse import urlparse

import ray

from actors.refs import fetch
from april_ray.config import AlgorithmConfig, LearnerConfig
from april_ray.learn.learner import Learner


@ray.remote
class LearnerActor:
    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0 to host the process group."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, learner_cfg: LearnerConfig, algo_cfg: AlgorithmConfig, temperature: float,
              max_response_len: int, mask_older_than: int, model_path: str, rank: int, world_size: int,
              master: tuple[str, int], seed: int = 0) -> None:
        os.environ["MASTER_ADDR"] = "127.0.0.1" if world_size == 1 else master[0]
        self.learner = Learner(model_path, learner_cfg, algo_cfg, temperature, max_response_len, mask_older_than,
                               rank, world_size, master[1], seed=seed)

    def train(self, handles: list, version: int) -> dict:
        return self.learner.train_step(fetch(handles), version)

    def publish(self):
        """Every rank gathers (ZeRO-3 partitions need all of them); rank 0 puts the weights once."""
        weights = self.learner.state_dict()
        return ray.put(weights) if self.learner.rank == 0 else None

    def broadcast_weights(self, urls: list[str], version: int, flush_cache: bool, bucket_mb: float,
                          backend: str, tp_size: int = 1) -> None:
        """Disaggregated servers: every rank gathers (ZeRO-3 partitions need all of them); rank 0
        broadcasts into every server (and each of its `tp_size` tensor-parallel ranks) through a group of
        its own, connected on the first call."""
        from april_ray.engine.sglang_client import SGLangEngine
        from april_ray.engine.weight_sync import BroadcastSender

        with self.learner.optim.full_weights() as named:
            if self.learner.rank != 0:
                return
            sender = getattr(self, "sender", None)
            if sender is None or sender.urls != urls:  # first call, or a restarted engine has a new server
                if sender is not None:
                    asyncio.run(sender.close())
                self.sender = BroadcastSender([SGLangEngine(u) for u in urls], _master_address(urls), backend,
                                              bucket_mb, tp_size, group_name=f"april-weights-{uuid.uuid4().hex[:8]}")
            asyncio.run(self.sender.send(named, version, flush_cache))

    def hand_over_weights(self, urls: list[str], version: int, flush_cache: bool, bucket_mb: float) -> None:
        """Colocated servers: this rank hands its full weights by handle (CUDA IPC on a GPU, shared memory
        on CPU) to the servers on its own devices."""
        from april_ray.engine.sglang_client import SGLangEngine
        from april_ray.engine.weight_sync import send_tensors

        async def send(named):
            for url in urls:
                client = SGLangEngine(url)
                await send_tensors(client, named, version, flush_cache, bucket_mb)
                await client.close()

        with self.learner.optim.full_weights() as named:
            asyncio.run(send(named))

    def weights_to_disk(self, path: str, base_model_dir: str, urls: list[str], version: int,
                        flush_cache: bool) -> None:
        """Every rank gathers; rank 0 writes a safetensors directory and has every server load it."""
        from april_ray.engine.sglang_client import SGLangEngine
        from april_ray.engine.weight_sync import save_for_disk_update

        async def load():
            clients = [SGLangEngine(u) for u in urls]
            await asyncio.gather(*[c.update_weights_from_disk(path, flush_cache, version) for c in clients])
            await asyncio.gather(*[c.close() for c in clients])

        with self.learner.optim.full_weights() as named:
            if self.learner.rank == 0:
                save_for_disk_update(named, path, base_model_dir)
                asyncio.run(load())

    def save(self, path: str, tokenizer_dir: str) -> None:
        self.learner.save(path, tokenizer_dir)

    def load(self, path: str) -> None:
        self.learner.load(path)


def _master_address(urls: list[str]) -> str:
    """Where the servers reach rank 0's rendezvous: loopback when they all run on this node's loopback."""
    local = all(urlparse(u).hostname in ("127.0.0.1", "localhost") for u in urls)
    return "127.0.0.1" if local else ray.util.get_node_ip_address()
