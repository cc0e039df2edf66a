"""Loss, advantage and off-policy functions against values computed by hand."""
import math

import pytest
import torch

from april_ray.config import StalenessConfig
from april_ray.learn import algorithms as algo
from april_ray.learn.corrections import TruncatedIS


def test_group_advantages_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    adv = algo.group_advantages(r)
    # group 1: mean 0.5, std 0.5 -> +-1; group 2: all equal -> 0 (no signal; the dynamic filter drops it)
    torch.testing.assert_close(adv, torch.tensor([[1.0, -1.0, -1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]), atol=1e-4, rtol=0)
    torch.testing.assert_close(algo.group_advantages(r, normalize_std=False)[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([100, 384, 448, 512, 600])
    # max 512, buffer 128: free up to 384, then linear to -1 at 512, clipped at -1 beyond
    torch.testing.assert_close(algo.overlong_penalty(lengths, 512, 128), torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))


def test_token_loss_clipping_by_hand():
    # one sequence, two tokens: ratios e^0.5 (clipped at 1.2 for A>0) and e^-0.5 (A>0: min picks ratio)
    logp = torch.tensor([[0.5, -0.5]], requires_grad=True)
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    out = algo.token_policy_loss(logp, old, torch.tensor([1.0]), mask, torch.ones(1, 2), 0.2, 0.2, "token_mean")
    expected = -(min(math.exp(0.5), 1.2) + min(math.exp(-0.5), 0.8 * 0 + math.exp(-0.5))) / 2
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    out.loss.backward()
    # the clipped token carries no gradient; the other one has d/dlogp = -ratio/2
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -math.exp(-0.5) / 2]]))
    assert out.metrics["loss/clip_fraction"] == pytest.approx(0.5)


def test_dapo_clip_higher_and_token_mean_vs_seq_mean():
    logp = torch.tensor([[0.24, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    w = torch.ones(2, 3)
    # ratio e^0.24 = 1.271: clipped at 1.2 with symmetric clip, not with clip_high = 0.28
    sym = algo.token_policy_loss(logp, torch.zeros(2, 3), adv, mask, w, 0.2, 0.2, "token_mean").loss.item()
    high = algo.token_policy_loss(logp, torch.zeros(2, 3), adv, mask, w, 0.2, 0.28, "token_mean").loss.item()
    assert sym == pytest.approx(-(1.2 + 1 + 1 - 1) / 4)
    assert high == pytest.approx(-(math.exp(0.24) + 1 + 1 - 1) / 4)
    seq = algo.token_policy_loss(logp, torch.zeros(2, 3), adv, mask, w, 0.2, 0.28, "seq_mean_token_mean").loss.item()
    assert seq == pytest.approx((-(math.exp(0.24) + 2) / 3 + 1) / 2)


def test_gspo_sequence_ratio_is_length_normalised():
    logp = torch.tensor([[0.1, 0.3, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = algo.sequence_policy_loss(logp, torch.zeros(1, 3), torch.tensor([1.0]), mask, torch.ones(1, 3), 0.5, 0.5)
    s = math.exp((0.1 + 0.3) / 2)
    assert out.loss.item() == pytest.approx(-s)
    out.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-s / 2, -s / 2, 0.0]]))
    clipped = algo.sequence_policy_loss(logp, torch.zeros(1, 3), torch.tensor([1.0]), mask, torch.ones(1, 3),
                                        3e-4, 4e-4)
    assert clipped.loss.item() == pytest.approx(-(1 + 4e-4)) and clipped.metrics["loss/clip_fraction"] == 1.0


def test_truncated_importance_sampling_and_staleness_mask():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    behaviour = torch.log(torch.tensor([[0.5, 0.1, 0.25]]))  # ratios 1, 5, 2
    versions = torch.tensor([[3, 1, 2]])
    mask = torch.ones(1, 3)
    w, keep, m = algo.off_policy_weights(old, behaviour, versions, 3, mask, correction=TruncatedIS(2.0),
                                         staleness=StalenessConfig(max_versions=1, policy="mask"))
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, 2.0]]))
    torch.testing.assert_close(keep, torch.tensor([[1.0, 0.0, 1.0]]))  # age 2 > 1: masked
    assert m["off_policy/token_ratio"] == pytest.approx(2 / 3)
    assert m["off_policy/staleness_max"] == 2 and m["off_policy/staleness_mean"] == pytest.approx(1.0)
    assert m["off_policy/is_truncated_ratio"] == pytest.approx(1 / 3)
    w_off, keep_off, _ = algo.off_policy_weights(old, behaviour, versions, 3, mask, correction=TruncatedIS(0),
                                                 staleness=StalenessConfig(max_versions=1, policy="keep"))
    assert torch.equal(w_off, torch.ones(1, 3)) and torch.equal(keep_off, mask)


def test_kl_k3_is_zero_at_reference_and_positive_elsewhere():
    mask = torch.ones(1, 2)
    lp = torch.tensor([[-1.0, -2.0]])
    assert algo.kl_k3(lp, lp, mask).item() == 0.0
    d = 0.3
    assert algo.kl_k3(lp, lp + d, mask).item() == pytest.approx(math.exp(d) - d - 1)


def test_decoupled_ppo_by_hand_clip_higher_acts_and_behaviour_enters_as_a_truncated_weight():
    # pi / pi_old = e^0.3 = 1.35 (above 1 + clip_high = 1.28) and e^-0.3 = 0.74 (below 1 - clip_low = 0.8);
    # pi_old / pi_behaviour = e^1 = 2.72 (truncated at 2) and e^-0.5 = 0.61
    logp = torch.tensor([[0.3, -0.3]], requires_grad=True)
    old = torch.zeros(1, 2)
    behaviour = torch.tensor([[-1.0, 0.5]])
    mask = torch.ones(1, 2)
    w, keep, _ = algo.off_policy_weights(old, behaviour, torch.zeros(1, 2, dtype=torch.long), 0, mask,
                                         correction=TruncatedIS(2.0), staleness=StalenessConfig(max_versions=0, policy="keep"))
    torch.testing.assert_close(w, torch.tensor([[2.0, math.exp(-0.5)]]))
    pos = algo.token_policy_loss(logp, old, torch.tensor([1.0]), keep, w, 0.2, 0.28, "token_mean")
    # A > 0: the first token is clipped at 1.28 (no gradient), the second keeps its ratio
    assert pos.loss.item() == pytest.approx(-(1.28 * 2.0 + math.exp(-0.3) * math.exp(-0.5)) / 2, rel=1e-6)
    assert pos.metrics["loss/clip_fraction"] == pytest.approx(0.5)
    pos.loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -math.exp(-0.3) * math.exp(-0.5) / 2]]))
    neg = algo.token_policy_loss(logp, old, torch.tensor([-1.0]), keep, w, 0.2, 0.28, "token_mean")
    # A < 0: the second token is clipped at 0.8, the first keeps its ratio (min of -r*1 and -1.28*1)
    assert neg.loss.item() == pytest.approx((math.exp(0.3) * 2.0 + 0.8 * math.exp(-0.5)) / 2, rel=1e-6)


def test_gspo_sequence_clip_acts_on_the_ratio_to_pi_old_and_behaviour_weights_stay_outside_it():
    logp = torch.tensor([[0.002, 0.0]], requires_grad=True)
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    w = torch.tensor([[1.0, 1.0]])
    # s = exp(0.001) = 1.0010 > 1 + 4e-4: clipped for A > 0, and the clipped branch carries no gradient
    out = algo.sequence_policy_loss(logp, old, torch.tensor([1.0]), mask, w, 3e-4, 4e-4)
    assert out.loss.item() == pytest.approx(-(1 + 4e-4)) and out.metrics["loss/clip_fraction"] == 1.0
    out.loss.backward()
    assert torch.count_nonzero(logp.grad) == 0
    # a behaviour weight does not move the ratio back into the clip range: it scales the clipped loss
    w2 = torch.tensor([[math.exp(-0.002), 1.0]])
    scaled = algo.sequence_policy_loss(logp, old, torch.tensor([1.0]), mask, w2, 3e-4, 4e-4)
    assert scaled.loss.item() == pytest.approx(-(1 + 4e-4) * math.exp(-0.001))
    assert scaled.metrics["loss/clip_fraction"] == 1.0
    # a stale sequence (pi = pi_old, sampled by an older policy: weights e^-0.2 a token) with a negative
    # advantage keeps its gradient, the weight's geometric mean times the unclipped one (folded into the
    # ratio, e^-0.2 < 1 - 3e-4 would have clipped it away)
    stale = torch.zeros(1, 2, requires_grad=True)
    w3 = torch.full((1, 2), math.exp(-0.2))
    neg = algo.sequence_policy_loss(stale, old, torch.tensor([-1.0]), mask, w3, 3e-4, 4e-4)
    assert neg.loss.item() == pytest.approx(math.exp(-0.2)) and neg.metrics["loss/clip_fraction"] == 0.0
    neg.loss.backward()
    torch.testing.assert_close(stale.grad, torch.full((1, 2), math.exp(-0.2) / 2))


@pytest.mark.parametrize("name,aggregation,per_token", [("grpo", "seq_mean_token_mean", False),
                                                         ("dapo", "token_mean", True), ("gspo", "token_mean", False)])
def test_the_loss_is_chosen_once_from_the_algorithm_and_computes_its_function(name, aggregation, per_token):
    """`build_loss`: GSPO's sequence loss (always per sequence, whatever the aggregation says), else the token
    loss with the configured aggregation; calling it is calling that function with the configured clips."""
    from april_ray.config import AlgorithmConfig

    loss = algo.build_loss(AlgorithmConfig(name=name, clip_low=0.2, clip_high=0.28, loss_aggregation=aggregation))
    assert loss.per_token is per_token
    logp, mask = torch.tensor([[0.5, -0.5, 0.1], [0.3, 0.0, 0.0]]), torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    args = (logp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), mask, torch.ones(2, 3))
    if name == "gspo":
        expected = algo.sequence_policy_loss(*args, 0.2, 0.28)
    else:
        expected = algo.token_policy_loss(*args, 0.2, 0.28, aggregation)
    out = loss(*args)
    assert out.loss.item() == expected.loss.item() and out.metrics == expected.metrics
