"""The learner: one data-parallel rank of policy optimisation on a batch of samples.

`train_step(samples, version)` turns samples (whole groups) into padded micro-batches, recomputes the
current logprobs, applies the configured algorithm with off-policy correction, and takes one optimiser
step. There is one optimiser step per rollout batch, so pi_old is the current policy detached (no extra
forward pass); the behaviour logprobs recorded by the engines carry the staleness of partial rollouts.

The optimiser backend is chosen once, when the learner is built (`optim.py`): DeepSpeed ZeRO (gloo on
CPU, NCCL/RCCL on GPU) or plain torch AdamW on one rank.
"""
from __future__ import annotations

import random
from pathlib import Path

import torch

from april_ray.learn import algorithms as algo
from april_ray.batching import padded_chunks
from april_ray.config import AlgorithmConfig, LearnerConfig
from april_ray.learn.optim import build_optim
from april_ray.types import Sample


def collate(samples: list[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded inputs, and per response token: target, mask, behaviour logprob and version.

    Response token t of a sample sits at input position len(prompt) + t and is predicted by the logits
    at the position before it; every per-token tensor here is aligned to those logits positions."""
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    b = len(samples)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros(b, width - 1)
    behaviour = torch.zeros(b, width - 1)
    versions = torch.zeros(b, width - 1, dtype=torch.long)
    for row, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        ids[row, : p + r] = torch.tensor(s.prompt_ids + s.response_ids)
        mask[row, p - 1 : p - 1 + r] = 1
        behaviour[row, p - 1 : p - 1 + r] = torch.tensor(s.logprobs)
        versions[row, p - 1 : p - 1 + r] = torch.tensor(s.versions)
    return {"input_ids": ids, "mask": mask, "behaviour_logp": behaviour, "versions": versions}


def token_logprobs(model, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """log pi(token_{t+1} | tokens_<=t) under softmax(logits / temperature), as the engines sample."""
    logits = model(input_ids=input_ids).logits[:, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None])[..., 0]


def advantages_for(samples: list[Sample], algo_cfg: AlgorithmConfig, max_response_len: int) -> torch.Tensor:
    """Group-normalised advantages, per sample in input order (samples of a group are consecutive)."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float)
    if algo_cfg.overlong_buffer:
        lengths = torch.tensor([len(s.response_ids) for s in samples])
        rewards = rewards + algo.overlong_penalty(lengths, max_response_len, algo_cfg.overlong_buffer)
    group_ids = [s.group_id for s in samples]
    adv = torch.zeros_like(rewards)
    for gid in dict.fromkeys(group_ids):
        idx = torch.tensor([i for i, g in enumerate(group_ids) if g == gid])
        adv[idx] = algo.group_advantages(rewards[idx][None], algo_cfg.normalize_adv_std)[0]
    return adv


def policy_loss(logp, old_logp, adv, mask, weights, a: AlgorithmConfig) -> algo.LossOutput:
    if a.name == "gspo":
        return algo.sequence_policy_loss(logp, old_logp, adv, mask, weights, a.clip_low, a.clip_high)
    return algo.token_policy_loss(logp, old_logp, adv, mask, weights, a.clip_low, a.clip_high, a.loss_aggregation)


class Learner:
    def __init__(self, model_path: str, learner_cfg: LearnerConfig, algo_cfg: AlgorithmConfig,
                 temperature: float, max_response_len: int, mask_older_than: int = -1, rank: int = 0,
                 world_size: int = 1, master_port: int = 29500, device: str | None = None):
        """`temperature`: what the engines sample with (logprobs are scored under it).
        `mask_older_than`: tokens sampled more than this many versions ago are masked out of the loss (-1: none)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(learner_cfg.num_threads)
        torch.manual_seed(1234 + rank)
        random.seed(rank)
        self.cfg, self.algo = learner_cfg, algo_cfg
        self.temperature, self.max_response_len, self.mask_older_than = temperature, max_response_len, mask_older_than
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.pad_id = AutoTokenizer.from_pretrained(model_path).pad_token_id
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(self.device)
        model.train()
        self.ref = None
        if algo_cfg.kl_coef > 0:
            self.ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(self.device).eval()
        self.optim = build_optim(model, learner_cfg, rank, world_size, master_port)

    @property
    def model(self):
        """What the forward runs through (the DeepSpeed engine, or the module itself)."""
        return self.optim.model

    @property
    def module(self):
        return self.optim.module

    @property
    def optimizer(self):
        return self.optim.optimizer

    @property
    def steps(self) -> int:
        return self.optim.steps

    def train_step(self, samples: list[Sample], version: int) -> dict[str, float]:
        adv = advantages_for(samples, self.algo, self.max_response_len)
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        chunks = padded_chunks(lengths, self.cfg.micro_batch_tokens)
        total_tokens = sum(len(s.response_ids) for s in samples)
        sums: dict[str, float] = {}
        for k, idx in enumerate(chunks):
            part = [samples[i] for i in idx]
            batch = {key: t.to(self.device) for key, t in collate(part, self.pad_id).items()}
            out, stats = self._loss(batch, adv[idx].to(self.device), version)
            # Each micro-batch's loss is weighted by its share of the batch's response tokens.
            share = sum(len(s.response_ids) for s in part) / max(1, total_tokens)
            self.optim.backward(out * share, is_last=k == len(chunks) - 1)
            for key, v in stats.items():
                sums[key] = sums.get(key, 0.0) + v * share
        grad_norm = self.optim.step()
        rewards = [s.reward for s in samples]
        return sums | {"train/grad_norm": grad_norm, "train/reward_mean": sum(rewards) / len(rewards),
                       "train/response_len_mean": total_tokens / len(samples), "train/num_samples": len(samples),
                       "train/num_micro_batches": len(chunks), "train/lr": self.cfg.lr}

    def _loss(self, batch, adv, version):
        logp = token_logprobs(self.model, batch["input_ids"], self.temperature)
        old_logp = logp.detach()
        weights, keep, metrics = algo.off_policy_weights(
            old_logp, batch["behaviour_logp"], batch["versions"], version, batch["mask"],
            self.algo.tis_cap, self.mask_older_than)
        out = policy_loss(logp, old_logp, adv, keep, weights, self.algo)
        loss = out.loss
        metrics |= out.metrics
        if self.ref is not None:
            with torch.no_grad():
                ref_logp = token_logprobs(self.ref, batch["input_ids"], self.temperature)
            kl = algo.kl_k3(logp, ref_logp, keep)
            loss = loss + self.algo.kl_coef * kl
            metrics["loss/kl"] = float(kl)
        metrics["loss/policy"] = float(out.loss.detach())
        metrics["train/behaviour_logp_gap"] = float(algo.masked_mean((old_logp - batch["behaviour_logp"]).abs(),
                                                                     batch["mask"]))
        return loss, metrics

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full CPU weights for the engines (under ZeRO-3, every rank must call this: it gathers)."""
        return self.optim.full_state_dict()

    def save(self, path: str | Path, tokenizer_dir: str | None = None) -> None:
        path = Path(path)
        weights = self.state_dict()  # every rank takes part in gathering
        if self.rank == 0:
            self.module.save_pretrained(path / "policy", state_dict=weights, safe_serialization=True)
            if tokenizer_dir:
                from transformers import AutoTokenizer

                AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path / "policy")
        self.optim.save(path, self.rank)

    def load(self, path: str | Path) -> None:
        self.optim.load(Path(path))
