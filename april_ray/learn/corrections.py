"""Off-policy corrections: how much each token the engines sampled weighs in the loss, and the train-inference
mismatch by token age.

Every correction reads one ratio per token, r_t = pi_old(y_t) / pi_behaviour(y_t) = exp(old_logp - behaviour_logp):
the learner's probability of the token at the start of the train step (decoupled PPO's proximal policy; with
one mini-batch, the current policy detached) over the probability the engine recorded when it sampled the
token, possibly several versions ago. It is the ratio truncated IS has always used, so `tis` gives today's
weights to the bit; the PPO clip acts on pi / pi_old and never sees r_t.

A correction returns a weight per token that multiplies the token's loss, and which tokens it masked
(weight 0) or clipped. It acts only on what the loss trains: environment tokens and stale tokens stay
masked by the loss mask and the staleness bound, and a masked token still counts in the loss's mean, as
IcePop and OpenRLHF normalise. (The learner sums the loss units over every rank before the forward whose
pi_old a band needs, so a band cannot change them; and a step's loss scale does not move with how much a
band masks.) One correction is chosen, by `algorithm.correction`, when the learner is built.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from april_ray.config import AlgorithmConfig
from april_ray.learn.algorithms import masked_mean


@dataclass(frozen=True)
class Corrected:
    weights: torch.Tensor
    """[B, T]: each token's weight in the loss."""
    masked: torch.Tensor
    """[B, T] bool: tokens the correction weighs 0 (outside its band)."""
    clipped: torch.Tensor
    """[B, T] bool: tokens whose weight it truncated below r_t."""


class Correction(Protocol):
    def __call__(self, log_ratio: torch.Tensor, mask: torch.Tensor) -> Corrected:
        """`log_ratio`: log r_t, [B, T]; `mask`: the tokens the loss trains (a sequence's mean reads only those)."""


def _none_of(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(t, dtype=torch.bool)


@dataclass(frozen=True)
class TruncatedIS:
    """tis: w_t = min(r_t, cap) (truncated IS, Ionides 2008; Yao et al. 2025 for LLM rollouts); cap 0: w_t = 1."""

    cap: float

    def __call__(self, log_ratio, mask) -> Corrected:
        ratio = torch.exp(log_ratio)
        if self.cap <= 0:
            return Corrected(torch.ones_like(ratio), _none_of(ratio), _none_of(ratio))
        return Corrected(torch.clamp(ratio, max=self.cap), _none_of(ratio), ratio > self.cap)


@dataclass(frozen=True)
class IcePop:
    """icepop: w_t = r_t if low <= r_t <= high, else 0 (IcePop, Ring-1T 2025: a token whose probabilities
    disagree beyond the band gives no gradient, rather than a truncated one)."""

    low: float
    high: float

    def __call__(self, log_ratio, mask) -> Corrected:
        ratio = torch.exp(log_ratio)
        inside = (ratio >= self.low) & (ratio <= self.high)
        return Corrected(ratio * inside, ~inside, _none_of(ratio))


@dataclass(frozen=True)
class SeqMaskTIS:
    """seq_mask_tis: g_i = exp(mean_t log r_t) over sequence i's trained tokens; w_t = min(r_t, cap) if
    low <= g_i <= high, else 0 for every token of the sequence (geometric-mean sequence masking, as
    OpenRLHF's seq-mask-tis and verl's geometric rejection; token TIS inside, cap 0: weight 1)."""

    low: float
    high: float
    cap: float

    def __call__(self, log_ratio, mask) -> Corrected:
        g = torch.exp(masked_mean(log_ratio, mask, dim=1))
        inside = ((g >= self.low) & (g <= self.high))[:, None]
        tis = TruncatedIS(self.cap)(log_ratio, mask)
        return Corrected(tis.weights * inside, (~inside).expand_as(log_ratio), tis.clipped & inside)


@dataclass(frozen=True)
class NoCorrection:
    """none: w_t = 1, the behaviour policy ignored (the on-policy assumption)."""

    def __call__(self, log_ratio, mask) -> Corrected:
        return Corrected(torch.ones_like(log_ratio), _none_of(log_ratio), _none_of(log_ratio))


def corrections(cfg: AlgorithmConfig) -> dict[str, Correction]:
    """Every correction, by its `algorithm.correction` name, under the config's tis_cap and band."""
    low, high = cfg.correction_band
    return {"tis": TruncatedIS(cfg.tis_cap), "icepop": IcePop(low, high),
            "seq_mask_tis": SeqMaskTIS(low, high, cfg.tis_cap), "none": NoCorrection()}


def build_correction(cfg: AlgorithmConfig) -> Correction:
    """The correction of `algorithm.correction`, chosen once (when the learner is built)."""
    return corrections(cfg)[cfg.correction]


MISMATCH = ("num_tokens", "num_trained_tokens", "log_ratio_mean", "k1", "k2", "k3")
"""The per-age sums of `MismatchTally`, then one count per compared correction."""


class MismatchTally:
    """Train-inference mismatch by token age (the learner's version minus the token's), summed over a train
    step's micro-batches and then over the ranks; `metrics` turns the sums into `mismatch/` keys.

    Over every loss-mask token (stale ones too): the mean log r_t and three estimates of
    KL(pi_behaviour || pi_old), unbiased for k1 and k3 since the tokens were sampled by pi_behaviour (Schulman's
    k1 = -log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r, with r = pi_old / pi_behaviour). Over the tokens the
    loss trains: the share each compared correction masks or clips (what it would do, whichever is active).
    """

    def __init__(self, compared: dict[str, Correction]):
        self.compared = compared
        self.sums = torch.zeros(0, len(MISMATCH) + len(compared), dtype=torch.float64)

    def add(self, log_ratio: torch.Tensor, age: torch.Tensor, mask: torch.Tensor, keep: torch.Tensor) -> None:
        """One micro-batch: `mask` its loss-mask tokens, `keep` those the loss trains, all [B, T]."""
        on = mask > 0
        lr = log_ratio.detach()[on].double()
        trained = keep[on] > 0
        cols = [torch.ones_like(lr), trained.double(), lr, -lr, lr.square() / 2, torch.expm1(lr) - lr]
        for correction in self.compared.values():
            c = correction(log_ratio.detach(), keep)
            cols.append(((c.masked | c.clipped)[on] & trained).double())
        ages = age[on].long().clamp(min=0)  # as the staleness mask reads it: a newer token than the learner's is fresh
        rows = int(ages.max()) + 1 if ages.numel() else 0
        self._grow(rows)
        self.sums.index_add_(0, ages.cpu(), torch.stack(cols, dim=1).cpu())  # the sums live on the CPU

    def _grow(self, rows: int) -> None:
        if rows > len(self.sums):
            self.sums = torch.cat([self.sums, self.sums.new_zeros(rows - len(self.sums), self.sums.shape[1])])

    def metrics(self, over_ranks=lambda values, op: values) -> dict[str, float]:
        """`mismatch/age{a}/...` for each age with a token, and `mismatch/...` over every age. `over_ranks`
        reduces a list of numbers over the learner ranks (every rank calls it, and every rank returns the
        same keys and values)."""
        self._grow(int(over_ranks([len(self.sums)], "max")[0]))
        if not len(self.sums):  # no rank had a token (every rank agrees: the length is the ranks' maximum)
            return {}
        sums = torch.tensor(over_ranks(self.sums.flatten().tolist(), "sum"), dtype=torch.float64).view_as(self.sums)
        out: dict[str, float] = {}
        for age, row in enumerate(sums):
            if row[0] > 0:
                out |= self._keys(f"mismatch/age{age}/", row)
        return out | self._keys("mismatch/", sums.sum(0))

    def _keys(self, prefix: str, row: torch.Tensor) -> dict[str, float]:
        tokens, trained = float(row[0]), float(row[1])
        out = {f"{prefix}num_tokens": tokens, f"{prefix}num_trained_tokens": trained}
        out |= {f"{prefix}{name}": float(row[i]) / max(tokens, 1.0) for i, name in enumerate(MISMATCH) if i >= 2}
        for j, name in enumerate(self.compared):
            out[f"{prefix}{name}_share"] = float(row[len(MISMATCH) + j]) / max(trained, 1.0)
        return out
