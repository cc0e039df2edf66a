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
from april_ray.config import AlgorithmConfig, LearnerConfig, StalenessConfig
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
              max_response_len: int, staleness: StalenessConfig, model_path: str, rank: int, world_size: int,
              master: tuple[str, int], seed: int = 0) -> None:
        os.environ["MASTER_ADDR"] = "127.0.0.1" if world_size == 1 else master[0]
        self.learner = Learner(model_path, learner_cfg, algo_cfg, temperature, max_response_len, staleness=staleness,
                               rank=rank, world_size=world_size, master_port=master[1], seed=seed)

    def train(self, handles: list, version: int) -> dict:
        return self.learner.train_step(fetch(handles), version)

    def publish(self):
        """Every rank gathers (ZeRO-3 partitions need all of them); rank 0 puts the weights once."""
        weights = self.learner.state_dict()
        return ray.put(weights) if self.learner.rank == 0 else None

    def broadcast_weights(self, servers: list[tuple[str, str]], version: int, flush_cache: bool, bucket_mb: float,
                          backend: str, tp_size: int = 1) -> list[str]:
        """Disaggregated servers, each (URL, admin key): every rank gathers (ZeRO-3 partitions need all of
        them); rank 0 broadcasts into every server that answers (and each of its `tp_size` tensor-parallel
        ranks) through a group of its own. Returns the URLs of the servers that loaded the weights."""
        from april_ray.engine.weight_sync import BroadcastSender

        with self.learner.optim.full_weights() as named:
            if self.learner.rank != 0:
                return []
            if getattr(self, "sender", None) is None:
                self.sender = BroadcastSender(_master_address([u for u, _ in servers]), backend, bucket_mb, tp_size,
                                              group_prefix=f"april-weights-{uuid.uuid4().hex[:8]}")
            return asyncio.run(self.sender.send(_clients(servers), named, version, flush_cache))

    def hand_over_weights(self, servers: list[tuple[str, str]], version: int, flush_cache: bool,
                          bucket_mb: float) -> list[str]:
        """Colocated servers, each (URL, admin key): this rank hands its full weights by handle (CUDA IPC on
        a GPU, shared memory on CPU) to the servers on its own devices. Returns the URLs that loaded them."""
        from april_ray.engine.weight_sync import send_tensors, send_to_each

        with self.learner.optim.full_weights() as named:
            return asyncio.run(send_to_each(_clients(servers), lambda c: send_tensors(c, named, version, flush_cache,
                                                                                      bucket_mb)))

    def weights_to_disk(self, path: str, base_model_dir: str, servers: list[tuple[str, str]], version: int,
                        flush_cache: bool) -> list[str]:
        """Every rank gathers; rank 0 writes a safetensors directory and has every server load it. Returns
        the URLs of the servers that loaded it."""
        from april_ray.engine.weight_sync import save_for_disk_update, send_to_each

        with self.learner.optim.full_weights() as named:
            if self.learner.rank != 0:
                return []
            save_for_disk_update(named, path, base_model_dir)
            return asyncio.run(send_to_each(_clients(servers),
                                            lambda c: c.update_weights_from_disk(path, flush_cache, version)))

    def save(self, path: str, tokenizer_dir: str) -> None:
        self.learner.save(path, tokenizer_dir)

    def load(self, path: str) -> None:
        self.learner.load(path)


def _clients(servers: list[tuple[str, str]]) -> list:
    from april_ray.engine.sglang_client import SGLangEngine

    return [SGLangEngine(url, admin_api_key=key) for url, key in servers]


def _master_address(urls: list[str]) -> str:
    """Where the servers reach rank 0's rendezvous: loopback when they all run on this node's loopback."""
    local = all(urlparse(u).hostname in ("127.0.0.1", "localhost") for u in urls)
    return "127.0.0.1" if local else ray.util.get_node_ip_address()
