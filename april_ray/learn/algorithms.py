"""Policy-gradient losses for GRPO, DAPO and GSPO, with off-policy handling for partial rollouts.

All tensors are padded [B, T] over response tokens with a 0/1 `mask`. Three logprobs meet here:
- `logp`: the current policy's, with gradient;
- `old_logp`: pi_old, the policy at the start of this train step (detached);
- `behaviour_logp`: what the engine sampled with, recorded per token. For a partial rollout it can be
  several versions older than pi_old (recomputing it with the current policy would treat stale tokens
  as on-policy).
The off-policy correction (`corrections.py`; by default truncated IS, min(pi_old / pi_behaviour, tis_cap))
weighs each token's loss; tokens more than `max_versions` versions old are masked out instead, unless the
staleness policy is `keep`. Both act on the per-token versions.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from april_ray.config import AlgorithmConfig, StalenessConfig


@dataclass
class LossOutput:
    loss: torch.Tensor
    metrics: dict[str, float]


def group_advantages(rewards: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: each reward minus its group's mean, over the group's std. `rewards` is [groups, n]."""
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if not normalize_std:
        return centered
    return centered / (rewards.std(dim=1, keepdim=True, unbiased=False) + eps)


def overlong_penalty(lengths: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to max_len - cache_len, then linearly down to -1 at max_len."""
    over = lengths.float() - (max_len - cache_len)
    return torch.clamp(-over / cache_len, min=-1.0, max=0.0)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def off_policy_weights(old_logp, behaviour_logp, versions, version, mask, *, correction,
                       staleness: StalenessConfig) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(per-token weights, updated mask, metrics) from the engine's behaviour logprobs and versions; the
    mask keeps the tokens `staleness` trains. `correction` (corrections.py) weighs those by pi_old / pi_behaviour."""
    age = (version - versions) * mask
    keep = mask * staleness.trains(age)
    ratio = torch.exp(old_logp - behaviour_logp)
    corrected = correction(old_logp - behaviour_logp, keep)
    n = mask.sum().clamp(min=1)
    metrics = {
        "off_policy/token_ratio": float(((age > 0) * mask).sum() / n),
        "off_policy/staleness_mean": float(age.sum() / n),
        "off_policy/staleness_max": float(age.max()) if mask.any() else 0.0,
        "off_policy/masked_token_ratio": float((mask - keep).sum() / n),
        "off_policy/is_weight_mean": float(masked_mean(ratio, mask)),
        "off_policy/is_weight_max": float((ratio * mask).max()) if mask.any() else 0.0,
        "off_policy/is_truncated_ratio": float((corrected.clipped * mask).sum() / n),
        "off_policy/correction_masked_ratio": float((corrected.masked * keep).sum() / n),
    }
    return corrected.weights.detach(), keep, metrics


def _clip_metrics(ratio, adv, mask, low, high) -> dict[str, float]:
    clipped = ((ratio < 1 - low) & (adv < 0)) | ((ratio > 1 + high) & (adv > 0))
    return {"loss/clip_fraction": float(masked_mean(clipped.float(), mask)),
            "loss/ratio_mean": float(masked_mean(ratio.detach(), mask))}


def token_policy_loss(logp, old_logp, adv, mask, weights, clip_low: float, clip_high: float,
                      aggregation: str) -> LossOutput:
    """PPO-clip per token (GRPO with clip_low == clip_high; DAPO's clip-higher with clip_high > clip_low).

    aggregation: "token_mean" (DAPO: every token of the batch weighs the same) or "seq_mean_token_mean"
    (GRPO as published: mean over each sequence, then over sequences).
    """
    ratio = torch.exp(logp - old_logp)
    a = adv[:, None]
    per_token = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * a) * weights
    if aggregation == "token_mean":
        loss = masked_mean(per_token, mask)
    else:
        loss = masked_mean(per_token, mask, dim=1)[mask.sum(1) > 0].mean()
    return LossOutput(loss, _clip_metrics(ratio, a.expand_as(ratio), mask, clip_low, clip_high))


def sequence_policy_loss(logp, old_logp, adv, mask, weights, clip_low: float, clip_high: float) -> LossOutput:
    """GSPO: one length-normalised importance ratio per sequence, clipped at the sequence level.

    s_i = exp(mean_t(logp - old_logp)), its gradient spread over the tokens. The behaviour policy enters as
    in the token losses, only as a weight outside the clip: the sequence's geometric mean of its truncated
    token weights, w_i = exp(mean_t log w_t). (Inside s_i, the staleness of a partial rollout would move the
    ratio out of GSPO's narrow clip range, ~3e-4, before any update: no gradient for a stale sequence with
    a negative advantage.)
    """
    s = torch.exp(masked_mean(logp - old_logp, mask, dim=1))
    w = torch.exp(masked_mean(torch.log(weights.clamp(min=1e-8)), mask, dim=1))
    loss_seq = -torch.minimum(s * adv, torch.clamp(s, 1 - clip_low, 1 + clip_high) * adv) * w
    valid = mask.sum(1) > 0
    metrics = _clip_metrics(s[:, None], adv[:, None], valid[:, None].float(), clip_low, clip_high)
    return LossOutput(loss_seq[valid].mean(), metrics)


@dataclass(frozen=True)
class TokenLoss:
    """GRPO and DAPO: `token_policy_loss`, averaged over tokens (token_mean) or sequences."""

    clip_low: float
    clip_high: float
    aggregation: str

    @property
    def per_token(self) -> bool:
        """The loss averages over tokens (else over the sequences with a kept token)."""
        return self.aggregation == "token_mean"

    def __call__(self, logp, old_logp, adv, mask, weights) -> LossOutput:
        return token_policy_loss(logp, old_logp, adv, mask, weights, self.clip_low, self.clip_high, self.aggregation)


@dataclass(frozen=True)
class SequenceLoss:
    """GSPO: `sequence_policy_loss`, averaged over the sequences with a kept token."""

    clip_low: float
    clip_high: float
    per_token = False

    def __call__(self, logp, old_logp, adv, mask, weights) -> LossOutput:
        return sequence_policy_loss(logp, old_logp, adv, mask, weights, self.clip_low, self.clip_high)


def build_loss(cfg: AlgorithmConfig) -> TokenLoss | SequenceLoss:
    """The policy loss of `algorithm.name`, chosen once (when the learner is built)."""
    if cfg.name == "gspo":
        return SequenceLoss(cfg.clip_low, cfg.clip_high)
    return TokenLoss(cfg.clip_low, cfg.clip_high, cfg.loss_aggregation)


def kl_k3(logp, ref_logp, mask) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref), per token, averaged over tokens."""
    d = ref_logp - logp
    return masked_mean(torch.exp(d) - d - 1, mask)
