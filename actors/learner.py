"""Learner actor: one data-parallel rank, a shell around `april_ray.learn.learner.Learner`.

It fetches its own share of the batch from the sample handles the driver hands it (no rank-0 funnel).
"""
from __future__ import annotations

import os
import socket

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
              master: tuple[str, int]) -> None:
        os.environ["MASTER_ADDR"] = "127.0.0.1" if world_size == 1 else master[0]
        self.learner = Learner(model_path, learner_cfg, algo_cfg, temperature, max_response_len, mask_older_than,
                               rank, world_size, master[1])

    def train(self, handles: list, version: int) -> dict:
        return self.learner.train_step(fetch(handles), version)

    def publish(self):
        """Every rank gathers (ZeRO-3 partitions need all of them); rank 0 puts the weights once."""
        weights = self.learner.state_dict()
        return ray.put(weights) if self.learner.rank == 0 else None

    def save(self, path: str, tokenizer_dir: str) -> None:
        self.learner.save(path, tokenizer_dir)

    def load(self, path: str) -> None:
        self.learner.load(path)
