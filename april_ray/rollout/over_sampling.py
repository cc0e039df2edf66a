"""N', the groups APRIL keeps in flight: fixed (`rollout.over_sampling_batch_size=<integer>`), or chosen
at the end of every step (`=auto`) for the next one.

Auto observes two things of each step. Its occupancy: the samples held in engine calls (running, queued at
the engine, or finished and waiting in their group's call for a sibling), averaged over the step's wall,
per slot of the live engines. And the share of the batch's tokens the learner masks as stale (older than
`staleness.max_versions`). Occupancy grows in proportion to N'/N, so auto keeps a moving average of
occupancy per unit of N'/N and picks the factor that puts occupancy at `TARGET_OCCUPANCY`: a fifth more
samples held than slots, because held samples include finished ones waiting for their siblings, and a
slot freed mid-step should find a sample queued. The staleness bound comes first, through a ceiling on the
factor: a step whose batch had masked tokens sets it to `STEP_DOWN` times the factor, and each step without
any raises it by `STEP_UP`. Masked tokens show a few steps after the factor that caused them,
so a ceiling that sprang back at the first clean step would swing N' between the bound and the occupancy's
goal. N'/N stays within [1, rollout.over_sampling_max_factor]. The constants were chosen on the simulator
(tests/test_over_sampling.py).
"""
from __future__ import annotations

from april_ray.config import RolloutConfig, over_sampling_batch_size
from april_ray.schedule import build_schedule


class FixedOverSampling:
    """N' as configured."""

    def __init__(self, n: int, n_prime: int):
        self.n, self.n_prime = n, n_prime

    @property
    def batch_size(self) -> int:
        return self.n_prime

    @property
    def factor(self) -> float:
        return self.n_prime / self.n

    def observe(self, occupancy: float, masked_share: float) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class AdaptiveOverSampling:
    """N'/N from the occupancy and masked share of the steps so far (the module's docstring)."""

    TARGET_OCCUPANCY = 1.2
    SMOOTHING = 0.2
    """Weight of the last step in the moving average: one step's lengths are noisy, and a factor that
    jitters leaves groups waiting in the store each time it drops."""
    STEP_DOWN = 0.85
    STEP_UP = 0.2
    """Additive rise and multiplicative fall of the ceiling, as in congestion control: it settles where the
    steps with masked tokens are rare enough."""

    def __init__(self, n: int, max_factor: float, factor: float = 1.5):
        self.n, self.max_factor = n, max_factor
        self.factor = min(max_factor, factor)
        self.ceiling = max_factor
        self.occupancy_per_factor: float | None = None

    @property
    def batch_size(self) -> int:
        return min(over_sampling_batch_size(self.factor, self.n), int(self.max_factor * self.n))

    def observe(self, occupancy: float, masked_share: float) -> None:
        seen = occupancy / self.factor
        avg = self.occupancy_per_factor
        avg = self.occupancy_per_factor = seen if avg is None else avg + self.SMOOTHING * (seen - avg)
        goal = self.TARGET_OCCUPANCY / avg if avg > 0 else self.factor
        if masked_share > 0:
            self.ceiling = max(1.0, self.STEP_DOWN * self.factor)
        else:
            self.ceiling = min(self.max_factor, self.ceiling + self.STEP_UP)
        self.factor = min(self.ceiling, max(1.0, goal))

    def state_dict(self) -> dict:
        return {"factor": self.factor, "ceiling": self.ceiling, "occupancy_per_factor": self.occupancy_per_factor}

    def load_state_dict(self, state: dict) -> None:
        self.factor = min(self.max_factor, max(1.0, float(state["factor"])))
        self.ceiling = min(self.max_factor, max(1.0, float(state.get("ceiling", self.max_factor))))
        self.occupancy_per_factor = state["occupancy_per_factor"]


def build_over_sampling(cfg: RolloutConfig) -> FixedOverSampling | AdaptiveOverSampling:
    """The N' of `cfg.schedule`: N for a schedule that does not over-provision (sync); else N', fixed or auto."""
    n = cfg.rollout_batch_size
    if not build_schedule(cfg.schedule).over_provisions:
        return FixedOverSampling(n, n)
    if cfg.over_sampling_batch_size == "auto":
        return AdaptiveOverSampling(n, cfg.over_sampling_max_factor)
    return FixedOverSampling(n, cfg.over_sampling_batch_size)
