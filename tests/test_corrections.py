"""The off-policy corrections (april_ray/learn/corrections.py) on hand-made logprobs, a token just inside and
just outside each band edge; the mismatch metrics by token age; the band's config errors."""
import math
from dataclasses import replace

import pytest
import torch

from april_ray.config import AlgorithmConfig, ConfigError, LearnerConfig, StalenessConfig, load_config
from april_ray.learn import algorithms as algo
from april_ray.learn.corrections import (IcePop, MismatchTally, NoCorrection, SeqMaskTIS, TruncatedIS,
                                         build_correction, corrections)

EPS = 0.01  # in log space: a ratio about 1% inside or outside an edge
LOW, HIGH = math.log(0.5), math.log(2.0)


def logs(*values) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)


def test_tis_is_the_truncated_weight_the_learner_always_had_to_the_bit():
    g = torch.Generator().manual_seed(0)
    old, behaviour = -torch.rand(4, 16, generator=g) * 3, -torch.rand(4, 16, generator=g) * 3
    mask = (torch.rand(4, 16, generator=g) > 0.2).float()
    for cap in (2.0, 1.5, 0.0):
        today = torch.clamp(torch.exp(old - behaviour), max=cap) if cap > 0 else torch.ones(4, 16)
        w, _, _ = algo.off_policy_weights(old, behaviour, torch.zeros(4, 16, dtype=torch.long), 0, mask,
                                          correction=build_correction(AlgorithmConfig(tis_cap=cap)),
                                          staleness=StalenessConfig())
        assert torch.equal(w, today), cap
    assert AlgorithmConfig().correction == "tis"


def test_tis_clips_just_above_the_cap_and_not_just_below():
    c = TruncatedIS(2.0)(logs(HIGH - EPS, HIGH + EPS, 0.0, LOW - 1), torch.ones(1, 4))
    torch.testing.assert_close(c.weights, torch.tensor([[2 * math.exp(-EPS), 2.0, 1.0, 0.5 * math.exp(-1)]]))
    assert c.clipped.tolist() == [[False, True, False, False]] and not c.masked.any()
    off = TruncatedIS(0.0)(logs(HIGH + 1), torch.ones(1, 1))
    assert torch.equal(off.weights, torch.ones(1, 1)) and not off.clipped.any()


def test_icepop_masks_a_token_just_outside_either_edge_and_keeps_one_just_inside_at_its_ratio():
    c = IcePop(0.5, 2.0)(logs(LOW - EPS, LOW + EPS, 0.0, HIGH - EPS, HIGH + EPS), torch.ones(1, 5))
    inside = [0.0, 0.5 * math.exp(EPS), 1.0, 2 * math.exp(-EPS), 0.0]
    torch.testing.assert_close(c.weights, torch.tensor([inside]))
    assert c.masked.tolist() == [[True, False, False, False, True]] and not c.clipped.any()


def test_seq_mask_tis_masks_a_sequence_whose_geometric_mean_is_just_outside_the_band():
    # each row: two trained tokens whose mean log-ratio is just inside or outside an edge, and a third the loss
    # does not train (a stale or environment token) with a far larger ratio, which the mean must not read
    means = [HIGH - EPS, HIGH + EPS, LOW + EPS, LOW - EPS]
    log_ratio = torch.tensor([[m + 0.3, m - 0.3, 5.0] for m in means])
    mask = torch.tensor([[1.0, 1.0, 0.0]] * 4)
    c = SeqMaskTIS(0.5, 2.0, cap=2.0)(log_ratio, mask)
    assert c.masked[:, 0].tolist() == [False, True, False, True]
    assert c.masked.tolist() == [[m] * 3 for m in (False, True, False, True)]
    # inside: token TIS (min(r, 2)); outside: every token 0
    expected = torch.clamp(torch.exp(log_ratio), max=2.0) * torch.tensor([[1.0], [0.0], [1.0], [0.0]])
    torch.testing.assert_close(c.weights, expected)
    assert c.clipped.tolist() == [[True, False, True], [False] * 3, [False, False, True], [False] * 3]


def test_none_leaves_every_weight_at_one():
    c = NoCorrection()(logs(LOW - 1, 0.0, HIGH + 1), torch.ones(1, 3))
    assert torch.equal(c.weights, torch.ones(1, 3)) and not c.masked.any() and not c.clipped.any()


def test_the_correction_is_chosen_once_by_name_with_the_configs_band_and_cap():
    cfg = AlgorithmConfig(tis_cap=3.0, correction_band=[0.25, 4.0])
    assert corrections(cfg) == {"tis": TruncatedIS(3.0), "icepop": IcePop(0.25, 4.0),
                                "seq_mask_tis": SeqMaskTIS(0.25, 4.0, 3.0), "none": NoCorrection()}
    for name in ("tis", "icepop", "seq_mask_tis", "none"):
        assert build_correction(replace(cfg, correction=name)) == corrections(cfg)[name]


def test_a_corrections_mask_multiplies_into_the_loss_mask_and_masks_stay_masked():
    """Environment tokens (loss mask 0) and stale tokens stay out; icepop's mask is a weight of 0 on top, and
    the masked token still counts in the token mean's denominator."""
    old = torch.zeros(1, 5)
    behaviour = logs(0.0, -HIGH - 1, 0.0, 0.0, 0.0)  # token 1: r = 2e, outside the band
    versions = torch.tensor([[3, 3, 0, 3, 3]])  # token 2: three versions old, past max_versions = 1
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0, 1.0]])  # token 3: an environment token
    w, keep, m = algo.off_policy_weights(old, behaviour, versions, 3, mask, correction=IcePop(0.5, 2.0),
                                         staleness=StalenessConfig(max_versions=1))
    assert keep.tolist() == [[1, 1, 0, 0, 1]] and w.tolist() == [[1, 0, 1, 1, 1]]
    assert (w * keep).tolist() == [[1, 0, 0, 0, 1]]
    assert m["off_policy/correction_masked_ratio"] == pytest.approx(1 / 4)
    logp = torch.zeros(1, 5, requires_grad=True)
    out = algo.token_policy_loss(logp, old, torch.tensor([1.0]), keep, w, 0.2, 0.2, "token_mean")
    assert out.loss.item() == pytest.approx(-2 / 3)  # two tokens of weight 1 over the three trained


def test_mismatch_by_age_on_hand_made_tokens():
    """Two rows trained at version 5: ages 0 and 2 (log r = 0.1, -0.8), one stale token of age 4 (log r = 1.0,
    past the bound: counted, never trained) and one environment token (not counted)."""
    log_ratio = torch.tensor([[0.1, 0.1, -0.8, 1.0], [0.1, -0.8, -0.8, 7.0]])
    versions = torch.tensor([[5, 5, 3, 1], [5, 3, 3, 5]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    keep = mask * (versions >= 3)
    tally = MismatchTally(corrections(AlgorithmConfig(tis_cap=2.0, correction_band=[0.5, 2.0])))
    tally.add(log_ratio, 5 - versions, mask, keep)
    m = tally.metrics()

    def k(lr):
        return {"log_ratio_mean": lr, "k1": -lr, "k2": lr * lr / 2, "k3": math.expm1(lr) - lr}

    for age, lr, n in ((0, 0.1, 3), (2, -0.8, 3), (4, 1.0, 1)):
        assert m[f"mismatch/age{age}/num_tokens"] == n
        for key, value in k(lr).items():
            assert m[f"mismatch/age{age}/{key}"] == pytest.approx(value, rel=1e-6), (age, key)
    assert "mismatch/age1/num_tokens" not in m and "mismatch/age3/num_tokens" not in m
    assert m["mismatch/age4/num_trained_tokens"] == 0 and m["mismatch/age4/icepop_share"] == 0
    # r = e^-0.8 = 0.45 < 0.5: icepop masks age 2. The rows' trained tokens have geometric means e^-0.2 and
    # e^-0.5 (0.82, 0.61), inside: seq_mask_tis masks none; no r passes tis_cap. The age-4 token (r = e) is
    # outside the band but not trained: no correction's share counts it
    assert m["mismatch/age2/icepop_share"] == 1 and m["mismatch/age0/icepop_share"] == 0
    assert m["mismatch/age2/seq_mask_tis_share"] == 0 and m["mismatch/age2/tis_share"] == 0
    assert m["mismatch/num_tokens"] == 7 and m["mismatch/num_trained_tokens"] == 6
    assert m["mismatch/k1"] == pytest.approx((-0.3 + 2.4 - 1.0) / 7)
    assert m["mismatch/icepop_share"] == pytest.approx(3 / 6) and m["mismatch/seq_mask_tis_share"] == 0


def test_mismatch_seq_mask_and_tis_shares_and_the_sums_over_ranks():
    """A row whose trained tokens' geometric mean is below the band: seq_mask_tis masks all of them, tis clips
    the one above its cap. Over two ranks (each with these tokens) the counts double and the means stay."""
    log_ratio = torch.tensor([[-1.5, -1.5, 0.9]])  # mean -0.7 < log 0.5; r = e^0.9 = 2.46 > cap 2
    mask = torch.ones(1, 3)
    tally = MismatchTally({k: c for k, c in corrections(AlgorithmConfig()).items() if k != "none"})
    tally.add(log_ratio, torch.zeros(1, 3, dtype=torch.long), mask, mask)

    def two_ranks(values, op):  # another rank with the same tokens, and one age more (without tokens)
        return [v + 1 for v in values] if op == "max" else [2 * v for v in values]

    m = tally.metrics(two_ranks)
    assert m["mismatch/age0/num_tokens"] == 6 and "mismatch/age1/num_tokens" not in m
    assert m["mismatch/age0/log_ratio_mean"] == pytest.approx(-0.7)
    assert m["mismatch/age0/seq_mask_tis_share"] == 1
    assert m["mismatch/age0/tis_share"] == pytest.approx(1 / 3)
    assert m["mismatch/age0/icepop_share"] == pytest.approx(1)  # r = 0.22, 0.22 and 2.46: all outside
    assert set(m) == {f"mismatch/{p}{key}" for p in ("", "age0/") for key in (
        "num_tokens", "num_trained_tokens", "log_ratio_mean", "k1", "k2", "k3", "tis_share", "icepop_share",
        "seq_mask_tis_share")}
    assert MismatchTally({}).metrics() == {}


@pytest.mark.parametrize("override,key", [
    ("algorithm.correction_band=[-0.5,2.0]", "algorithm.correction_band"),
    ("algorithm.correction_band=[2.0,0.5]", "algorithm.correction_band"),
    ("algorithm.correction_band=[0.5,nan]", "algorithm.correction_band"),
    ("algorithm.correction_band=[nan,2.0]", "algorithm.correction_band"),
    ("algorithm.correction_band=[0.5]", "algorithm.correction_band"),
    ("algorithm.correction_band=[0.5,1.5,2.0]", "algorithm.correction_band"),
    ("algorithm.correction_band=[low,high]", "algorithm.correction_band"),
    ("algorithm.correction_band=2.0", "algorithm.correction_band"),
    ("algorithm.correction_band=[1.1,2.0]", "algorithm.correction_band"),  # masks every on-policy token
    ("algorithm.correction=mis", "algorithm.correction"),
])
def test_a_bad_band_or_correction_is_refused_at_start_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_band_and_correction_load_from_overrides_and_icepop_is_refused_with_gspo():
    cfg = load_config(None, ["algorithm.correction=seq_mask_tis", "algorithm.correction_band=[0.9,1.1]"])
    assert cfg.algorithm.correction == "seq_mask_tis" and cfg.algorithm.correction_band == [0.9, 1.1]
    assert load_config(None, []).algorithm.correction_band == [0.5, 2.0]
    with pytest.raises(ConfigError, match=r"algorithm\.correction: icepop .* algorithm\.name=gspo"):
        load_config(None, ["algorithm.name=gspo", "algorithm.correction=icepop"])


def test_the_learner_reports_mismatch_by_age_and_masks_with_icepop(random_model_dir):
    """Four samples of the step's version and four sampled three versions ago whose recorded logprobs are 1
    above the learner's (r = e^-1 = 0.37, under the band): icepop weighs those 0 and says so, and the step's
    `mismatch/` keys give each age's tokens and its log-ratio."""
    from tests.test_learner import batch_from_policy

    from april_ray.learn.learner import Learner

    samples = batch_from_policy(random_model_dir)
    samples = [s if i < 4 else replace(s, versions=[0] * len(s.response_ids), logprobs=[lp + 1 for lp in s.logprobs])
               for i, s in enumerate(samples)]
    samples = [s if i >= 4 else replace(s, versions=[3] * len(s.response_ids)) for i, s in enumerate(samples)]
    learner = Learner(str(random_model_dir), LearnerConfig(backend="torch", micro_batch_tokens=40),
                      AlgorithmConfig(correction="icepop"), temperature=1.0, max_response_len=32,
                      staleness=StalenessConfig(policy="keep"))
    m = learner.train_step(samples, version=3)
    fresh, stale = (sum(len(s.response_ids) for s in part) for part in (samples[:4], samples[4:]))
    assert m["mismatch/age0/num_tokens"] == fresh and m["mismatch/age3/num_tokens"] == stale
    assert abs(m["mismatch/age0/log_ratio_mean"]) < 1e-4
    assert m["mismatch/age3/log_ratio_mean"] == pytest.approx(-1, abs=1e-4)
    assert m["mismatch/age3/k3"] == pytest.approx(math.exp(-1), abs=1e-4)  # (r - 1) - log r = e^-1 - 1 + 1
    assert m["mismatch/age3/icepop_share"] == 1 and m["mismatch/age0/icepop_share"] == 0
    assert m["mismatch/age3/seq_mask_tis_share"] == 1 and m["mismatch/age3/tis_share"] == 0
    assert m["off_policy/correction_masked_ratio"] == pytest.approx(stale / (fresh + stale))


def test_the_mismatch_keys_become_gauges_by_age_and_an_age_gone_from_the_batch_is_no_longer_held():
    from actors.metrics import Held, StepMetrics, mismatch_by_age

    row = {"mismatch/age0/k3": 0.1, "mismatch/k3": 0.2, "mismatch/age3/icepop_share": 0.5, "rollout/reward_mean": 1}
    assert mismatch_by_age(row) == {"0": {"k3": 0.1}, "all": {"k3": 0.2}, "3": {"icepop_share": 0.5}}

    class Recorded:  # a Ray gauge or counter: what was set, by tags
        def __init__(self):
            self.values = {}

        def set(self, value, tags=None):
            self.values[tuple(sorted(tags.items()))] = value

        inc = set

    exported = StepMetrics.__new__(StepMetrics)  # its Ray metrics replaced by held recordings
    exported.log_ratio, exported.kl, exported.correction_share = (Held(Recorded()) for _ in range(3))
    exported.mismatch_tokens, exported.ages = Recorded(), set()

    def step(ages):
        fields = {"log_ratio_mean": -0.1, "k1": 0.1, "k2": 0.01, "k3": 0.005, "num_tokens": 7.0, "tis_share": 0.25}
        exported.record_mismatch({age: fields for age in ages})

    def held_ages(gauge):
        return {dict(tags)["age"] for (h, tags) in Held._values if h is gauge}

    step(["0", "2", "all"])
    assert held_ages(exported.kl) == {"0", "2", "all"}
    assert exported.kl.gauge.values[(("age", "2"), ("estimator", "k3"))] == 0.005
    assert exported.correction_share.gauge.values[(("age", "all"), ("correction", "tis"))] == 0.25
    assert set(exported.mismatch_tokens.values) == {(("age", "0"),), (("age", "2"),)}  # "all" is their sum
    step(["0", "all"])
    assert all(held_ages(g) == {"0", "all"} for g in (exported.log_ratio, exported.kl, exported.correction_share))


def test_plot_draws_the_mismatch_curves_of_every_age_any_run_has(tmp_path):
    import json

    from jobs.plot import mismatch_panels, plot, read_rows

    for name, ages in (("a", (0,)), ("b", (0, 2))):
        (tmp_path / name).mkdir()
        rows = [{"step": s, "time/wall_s": 10.0 * (s + 1), "train/reward_mean": 0.1, "mismatch/k3": 0.01 * s,
                 **{f"mismatch/age{a}/{k}": 0.01 * s * (a + 1) for a in ages for k in ("k3", "log_ratio_mean")},
                 "mismatch/icepop_share": 0.1} for s in range(3)]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs = [(name, read_rows(tmp_path / name)) for name in ("a", "b")]
    k3, log_ratio, shares = mismatch_panels(runs)
    assert [key for key, _, _ in k3[1]] == ["mismatch/k3", "mismatch/age0/k3", "mismatch/age2/k3"]
    assert "mismatch/icepop_share" in [key for key, _, _ in shares[1]]
    assert mismatch_panels([("a", [{"step": 0, "train/reward_mean": 0.1}])]) == []
    plot([tmp_path / "a", tmp_path / "b"], tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_token_newer_than_the_learners_version_counts_as_age_zero_as_the_staleness_mask_reads_it():
    tally = MismatchTally({})
    tally.add(torch.tensor([[0.2, 0.4]]), torch.tensor([[-1, 0]]), torch.ones(1, 2), torch.ones(1, 2))
    m = tally.metrics()
    assert m["mismatch/age0/num_tokens"] == 2 and m["mismatch/age0/log_ratio_mean"] == pytest.approx(0.3)
