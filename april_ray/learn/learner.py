"""The learner: one data-parallel rank of policy optimisation on a batch of samples.

`train_step(samples, version)` computes group advantages, shuffles the samples into
`learner.num_minibatches` PPO mini-batches and takes one optimiser step per mini-batch (decoupled PPO):
- the proximal policy pi_old is the policy at the start of the train step. With several mini-batches its
  logprobs come from one extra no-grad forward over the batch, and the clipped ratio pi / pi_old moves
  away from 1 from the second mini-batch on. With one mini-batch pi_old is the current policy detached
  (no extra forward): the ratio is 1 and the clip never acts, as in one-step GRPO.
- the behaviour policy (the engines' recorded logprobs, possibly several versions old for partial
  rollouts) enters only as the off-policy correction's weight per token (`algorithm.correction`,
  corrections.py; by default truncated IS, min(pi_old / pi_behaviour, tis_cap)). How far pi_old and the
  behaviour policy disagree is measured by token age every step (`mismatch/`, corrections.MismatchTally).
Each mini-batch runs as length-sorted micro-batches under a padded-token budget whose longest row is at most
`learner.max_spread` times its shortest; each micro-batch's loss is weighted by its share of the
mini-batch's loss units (tokens or sequences, per the aggregation) summed over every data-parallel rank, so
the gradient depends neither on how the mini-batch is cut nor on how the batch is split between ranks: the
ranks' averaged gradient is the whole batch's (DAPO's token mean weighs every token of the batch the same,
whichever rank holds it). Every rank takes as many mini-batches.

The optimiser backend is chosen once, when the learner is built (`optim.py`): DeepSpeed ZeRO (gloo on
CPU, NCCL/RCCL on GPU) or plain torch AdamW on one rank.
"""
from __future__ import annotations

import random
from pathlib import Path

import torch

from april_ray.learn import algorithms as algo
from april_ray.batching import padded_chunks
from april_ray.config import AlgorithmConfig, LearnerConfig, StalenessConfig, run_seeded
from april_ray.learn.corrections import MismatchTally, build_correction, corrections
from april_ray.learn.logprobs import num_chunks, packed_layout, padded_layout, selected_logprobs
from april_ray.learn.optim import build_optim
from april_ray.types import Sample


def collate(samples: list[Sample], pad_id: int, old_logp: list[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Right-padded inputs, and per response token: target, mask (the sample's loss mask: environment tokens
    are context, never trained), behaviour logprob and version (and the proximal logprob, when `old_logp`
    gives one tensor per sample over its response tokens).

    Response token t of a sample sits at input position len(prompt) + t and is predicted by the logits
    at the position before it; every per-token tensor here is aligned to those logits positions."""
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    b = len(samples)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    mask = torch.zeros(b, width - 1)
    behaviour = torch.zeros(b, width - 1)
    versions = torch.zeros(b, width - 1, dtype=torch.long)
    old = torch.zeros(b, width - 1) if old_logp is not None else None
    for row, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        ids[row, : p + r] = torch.tensor(s.prompt_ids + s.response_ids)
        mask[row, p - 1 : p - 1 + r] = 1 if s.loss_mask is None else torch.tensor(s.loss_mask, dtype=torch.float)
        behaviour[row, p - 1 : p - 1 + r] = torch.tensor(s.logprobs)
        versions[row, p - 1 : p - 1 + r] = torch.tensor(s.versions)
        if old is not None:
            old[row, p - 1 : p - 1 + r] = old_logp[row]
    batch = {"input_ids": ids, "mask": mask, "behaviour_logp": behaviour, "versions": versions,
             "lengths": torch.tensor([len(s.prompt_ids) + len(s.response_ids) for s in samples])}
    return batch | ({"old_logp": old} if old is not None else {})


def response_logprobs(logp: torch.Tensor, samples: list[Sample]) -> list[torch.Tensor]:
    """Each sample's row of `logp` (as `collate` aligns it) cut to its response tokens."""
    return [logp[row, len(s.prompt_ids) - 1 : len(s.prompt_ids) - 1 + len(s.response_ids)]
            for row, s in enumerate(samples)]


def packed_chunks(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices in length order, each chunk's total length under the budget (>= 1 row): packed rows have no
    padding to bound."""
    chunks: list[list[int]] = []
    total = 0
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        if chunks and total + lengths[i] <= max_tokens:
            chunks[-1].append(i)
            total += lengths[i]
        else:
            chunks.append([i])
            total = lengths[i]
    return chunks


def load_model(model_path: str, cfg: LearnerConfig, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation=cfg.attn_implementation)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`learner.dtype`, auto resolved: bfloat16 on a GPU, float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def advantages_for(samples: list[Sample], algo_cfg: AlgorithmConfig, max_response_len: int) -> torch.Tensor:
    """Group-normalised advantages, per sample in input order (samples of a group are consecutive)."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float)
    if algo_cfg.overlong_buffer:
        lengths = torch.tensor([s.num_model_tokens for s in samples])
        rewards = rewards + algo.overlong_penalty(lengths, max_response_len, algo_cfg.overlong_buffer)
    group_ids = [s.group_id for s in samples]
    adv = torch.zeros_like(rewards)
    for gid in dict.fromkeys(group_ids):
        idx = torch.tensor([i for i, g in enumerate(group_ids) if g == gid])
        adv[idx] = algo.group_advantages(rewards[idx][None], algo_cfg.normalize_adv_std)[0]
    return adv


_PER_RESPONSE_TOKEN = ("off_policy/", "train/behaviour_logp_gap")
"""Metrics over every response token of a micro-batch, kept or masked (the others: over the kept ones)."""


class Learner:
    def __init__(self, model_path: str, learner_cfg: LearnerConfig, algo_cfg: AlgorithmConfig,
                 temperature: float, max_response_len: int, *, staleness: StalenessConfig = StalenessConfig(),
                 rank: int = 0, world_size: int = 1, master_port: int = 29500, device: str | None = None,
                 seed: int = 0):
        """`temperature`: what the engines sample with (logprobs are scored under it).
        `staleness`: tokens sampled more than `max_versions` versions ago are masked out of the loss (unless
        the policy is `keep`).
        `seed`: the run's seed (mini-batch order; torch's generator)."""
        from april_ray.task.tokenizer import load_tokenizer

        torch.set_num_threads(learner_cfg.num_threads)
        torch.manual_seed(run_seeded(1234 + rank, seed))
        self.rng = random.Random(seed * 1_000_003 + rank)
        self.cfg, self.algo = learner_cfg, algo_cfg
        self.policy_loss = algo.build_loss(algo_cfg)
        self.correction = build_correction(algo_cfg)
        self.compared = {k: c for k, c in corrections(algo_cfg).items() if k != "none"}  # in `mismatch/`
        self.temperature, self.max_response_len, self.staleness = temperature, max_response_len, staleness
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.pad_id = load_tokenizer(model_path).pad_token_id
        self.dtype = resolve_dtype(learner_cfg.dtype, self.device)
        self.packed = learner_cfg.packing == "on" or (learner_cfg.packing == "auto" and self.device.type == "cuda"
                                                      and learner_cfg.attn_implementation == "flash_attention_2")
        # fp32 weights: the optimiser's masters (DeepSpeed's bf16 section makes its own bf16 copy)
        model = load_model(model_path, learner_cfg, torch.float32).to(self.device).train()
        if learner_cfg.gradient_checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        self.ref = None
        if algo_cfg.kl_coef > 0:
            self.ref = load_model(model_path, learner_cfg, self.dtype).to(self.device).eval()
        self.optim = build_optim(model, learner_cfg, rank, world_size, master_port, self.dtype)

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
        order = list(range(len(samples)))
        if self.cfg.num_minibatches > 1:
            self.rng.shuffle(order)
        # the optimiser steps are collective: every rank takes as many, at most one per sample of the
        # rank with the fewest (every rank joins this before any fails, so none waits for a failed one)
        k = int(self.optim.over_ranks([min(self.cfg.num_minibatches, len(samples))], "min")[0])
        if not k:
            raise ValueError(f"learner rank {self.rank}: a rank has no samples to train on (a batch of fewer "
                             f"groups than learner.num_ranks)")
        minibatches = [order[i::k] for i in range(k)]
        old = self.proximal_logprobs(samples) if k > 1 else None
        sums: dict[str, float] = {}
        tally = MismatchTally(self.compared)
        for idx in minibatches:
            part_old = [old[i] for i in idx] if old is not None else None
            for key, v in self._optimiser_step([samples[i] for i in idx], adv[idx], part_old, version, tally).items():
                sums[key] = max(sums.get(key, v), v) if key.endswith("_max") else sums.get(key, 0.0) + v / k
        rewards = [s.reward for s in samples]
        total_tokens = sum(len(s.response_ids) for s in samples)
        return sums | tally.metrics(self.optim.over_ranks) | {
            "train/reward_mean": sum(rewards) / len(rewards), "train/num_minibatches": k,
            "train/response_len_mean": total_tokens / len(samples), "train/num_samples": len(samples),
            "train/lr": self.cfg.lr}

    def micro_batches(self, samples: list[Sample]) -> tuple[list[list[int]], int]:
        """(length-sorted micro-batches, how many of them are this rank's own). Every rank runs as many: a
        rank that cuts fewer than another repeats its last one, which weighs 0 in the loss (ZeRO-2/3
        communicate in every micro-batch's forward or backward)."""
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        if self.packed:
            chunks = packed_chunks(lengths, self.cfg.micro_batch_tokens)
        else:
            chunks = padded_chunks(lengths, self.cfg.micro_batch_tokens, self.cfg.max_spread)
        return chunks + [chunks[-1]] * (self.optim.most_of_any_rank(len(chunks)) - len(chunks)), len(chunks)

    @torch.no_grad()
    def proximal_logprobs(self, samples: list[Sample]) -> list[torch.Tensor]:
        """pi_old: every sample's response-token logprobs under the current weights (one no-grad forward)."""
        out: list[torch.Tensor] = [torch.empty(0)] * len(samples)
        for idx in self.micro_batches(samples)[0]:  # a repeat recomputes the same values
            part = [samples[i] for i in idx]
            batch = {k: t.to(self.device) for k, t in collate(part, self.pad_id).items()}
            for i, lp in zip(idx, response_logprobs(self.logprobs(self.model, batch).float().cpu(), part)):
                out[i] = lp
        return out

    def _optimiser_step(self, samples, adv, old, version, tally: MismatchTally) -> dict[str, float]:
        """One optimiser step on a mini-batch, accumulated over its micro-batches.

        A micro-batch's loss is its mean over its loss units times its share of the units of the whole
        mini-batch, every rank's together, times the number of ranks whose gradients are averaged: the
        average is then the gradient of the mini-batch's loss however it is split. Its metrics are weighted
        by its share of this rank's part (the driver averages the ranks'). `tally` adds this rank's own
        micro-batches' mismatch."""
        chunks, num_own = self.micro_batches(samples)
        batches = []
        for idx in chunks:
            part = [samples[i] for i in idx]
            batch = collate(part, self.pad_id, [old[i] for i in idx] if old is not None else None)
            batches.append(({key: t.to(self.device) for key, t in batch.items()}, adv[idx].to(self.device)))
        units = [self._loss_units(b, version) if j < num_own else (0.0, 0.0, 0.0) for j, (b, _) in enumerate(batches)]
        own = [sum(u[i] for u in units) for i in range(3)]
        total = [max(1.0, t) for t in self.optim.over_ranks(own[:2], "sum")]
        scale = self.optim.ranks_averaged
        sums: dict[str, float] = {}
        for k, ((batch, a), unit) in enumerate(zip(batches, units)):
            policy, kl, stats = self._loss(batch, a, version, tally if k < num_own else None)
            # a micro-batch with no kept sequence has a NaN sequence mean; its share of the loss is 0
            loss = policy * (scale * unit[0] / total[0]) if unit[0] > 0 else (policy.nan_to_num() * 0)
            if kl is not None:
                loss = loss + self.algo.kl_coef * kl * (scale * unit[1] / total[1])
            self.optim.backward(loss, is_last=k == len(batches) - 1)
            shares = [u / max(1.0, t) for u, t in zip(unit, own)]
            for key, v in stats.items():
                if key.endswith("_max"):
                    sums[key] = max(sums.get(key, v), v)
                    continue
                share = shares[2] if key.startswith(_PER_RESPONSE_TOKEN) else shares[0] if key == "loss/policy" else shares[1]
                # every key on every rank (the driver reduces them by key), a micro-batch without units adding 0
                sums[key] = sums.get(key, 0.0) + (v * share if share > 0 else 0.0)
        grad_norm = self.optim.step()
        return sums | {"train/grad_norm": grad_norm, "train/num_micro_batches": num_own}

    def _loss_units(self, batch, version) -> tuple[float, float, float]:
        """(policy-loss units, kept tokens, response tokens) of a micro-batch: the policy loss averages over
        tokens (token_mean) or over sequences with a kept token (seq_mean_token_mean, GSPO)."""
        behaviour = batch["behaviour_logp"]
        _, keep, _ = algo.off_policy_weights(behaviour, behaviour, batch["versions"], version, batch["mask"],
                                             correction=self.correction, staleness=self.staleness)
        tokens = float(keep.sum())
        units = tokens if self.policy_loss.per_token else float((keep.sum(1) > 0).sum())
        return units, tokens, float(batch["mask"].sum())

    def _loss(self, batch, adv, version, tally: MismatchTally | None = None):
        """This micro-batch's policy loss (its mean over its loss units), its KL to the reference (None
        without one; a mean over kept tokens) and its metrics, each over the micro-batch; its mismatch by
        token age goes to `tally` (None: a repeated micro-batch, counted once already)."""
        logp = self.logprobs(self.model, batch)
        old_logp = batch["old_logp"] if "old_logp" in batch else logp.detach()
        weights, keep, metrics = algo.off_policy_weights(
            old_logp, batch["behaviour_logp"], batch["versions"], version, batch["mask"],
            correction=self.correction, staleness=self.staleness)
        if tally is not None:
            tally.add(old_logp - batch["behaviour_logp"], version - batch["versions"], batch["mask"], keep)
        out = self.policy_loss(logp, old_logp, adv, keep, weights)
        metrics |= out.metrics
        kl = None
        if self.ref is not None:
            with torch.no_grad():
                ref_logp = self.logprobs(self.ref, batch)
            kl = algo.kl_k3(logp, ref_logp, keep)
            metrics["loss/kl"] = float(kl)
        metrics["loss/policy"] = float(out.loss.detach())
        metrics["train/behaviour_logp_gap"] = float(algo.masked_mean((old_logp - batch["behaviour_logp"]).abs(),
                                                                     batch["mask"]))
        return out.loss, kl, metrics

    def logprobs(self, model, batch) -> torch.Tensor:
        """fp32 log-probs of the micro-batch's loss positions (0 elsewhere), in `collate`'s padded layout:
        the model reads padded rows or one packed row, and the vocabulary head runs in chunks of tokens."""
        ids, positions = batch["input_ids"], batch["mask"] > 0
        if self.packed:
            layout = packed_layout(ids, batch["lengths"].tolist(), positions)
        else:
            layout = padded_layout(ids, positions)
        chunks = self.optim.lockstep(num_chunks(len(layout.src), self.cfg.logprob_chunk_tokens))
        with self.optim.autocast():
            return selected_logprobs(model, layout, self.temperature, chunks)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full CPU weights for the engines (under ZeRO-3, every rank must call this: it gathers)."""
        return self.optim.full_state_dict()

    def save(self, path: str | Path, tokenizer_dir: str | None = None) -> None:
        path = Path(path)
        weights = self.state_dict()  # every rank takes part in gathering
        if self.rank == 0:
            self.module.save_pretrained(path / "policy", state_dict=weights, safe_serialization=True)
            if tokenizer_dir:
                from april_ray.task.tokenizer import load_tokenizer

                load_tokenizer(tokenizer_dir).save_pretrained(path / "policy")
        self.optim.save(path, self.rank)

    def load(self, path: str | Path) -> None:
        self.optim.load(Path(path))
