"""Learner actor: one data-parallel rank, a shell around `april_ray.learn.learner.Learner`.

It fetches its own share of the batch from the sample handles the driver hands it (no rank-0 funnel), and
sends its weights to the engines through the one channel the job configured (`april_ray.weights`).
"""
from __future__ import annotations

import os
import socket

import ray

from actors.refs import fetch
from april_ray.config import AlgorithmConfig, EngineConfig, LearnerConfig, StalenessConfig
from april_ray.types import Delivery
from april_ray.weights import build_sender


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
              master: tuple[str, int], engine_cfg: EngineConfig, weights_dir: str, seed: int = 0) -> None:
        """`weights_dir`: where the disk channel writes the weights every server loads."""
        from april_ray.learn.learner import Learner  # torch, imported by the ranks and not by the driver

        os.environ["MASTER_ADDR"] = "127.0.0.1" if world_size == 1 else master[0]
        self.learner = Learner(model_path, learner_cfg, algo_cfg, temperature, max_response_len, staleness=staleness,
                               rank=rank, world_size=world_size, master_port=master[1], seed=seed)
        self.sender = build_sender(engine_cfg.weight_sync, rank, world_size,
                                   flush_cache=not engine_cfg.reuse_stale_kv, bucket_mb=engine_cfg.weight_bucket_mb,
                                   backend=engine_cfg.broadcast_backend,
                                   tp_size=engine_cfg.tp_size, node_address=ray.util.get_node_ip_address(),
                                   disk_path=weights_dir, base_model_dir=model_path, put=ray.put)

    def train(self, handles: list, version: int) -> dict:
        return self.learner.train_step(fetch(handles), version)

    def send_weights(self, servers: list[tuple[str, str] | None], version: int) -> Delivery:
        """Every rank gathers (ZeRO-3 partitions need all of them) and sends what its channel sends.
        `servers`: each engine's (URL, admin key), None where it is down (empty for the object store)."""
        with self.learner.optim.full_weights() as named:
            return self.sender.send(named, _clients(servers), version)

    def put_weights(self):
        """The full weights in the object store (rank 0; every rank gathers): what a restarted engine is
        caught up from when the weights went to the servers by another channel."""
        weights = self.learner.state_dict()
        return ray.put(weights) if self.learner.rank == 0 else None

    def save(self, path: str, tokenizer_dir: str) -> None:
        self.learner.save(path, tokenizer_dir)

    def load(self, path: str) -> None:
        self.learner.load(path)


def _clients(servers: list[tuple[str, str] | None]) -> list:
    """An HTTP client per engine server, None where an engine has none (the in-process CPU engine)."""
    if all(s is None for s in servers):
        return [None] * len(servers)  # no HTTP client stack imported for in-process engines
    from april_ray.engine.sglang_client import SGLangEngine

    return [None if s is None else SGLangEngine(s[0], admin_api_key=s[1]) for s in servers]
