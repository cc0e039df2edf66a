"""The simulator's cost model (sim/hardware.py): model sizes, KV capacity, and a step's cost by hand."""
import math
import random

import pytest

from sim.hardware import ACCELERATORS, StepCost, gpu_step_cost, kv_capacity_tokens, model_spec


def test_qwen3_4b_sizes_and_h100_capacity_by_hand():
    m = model_spec("/nonexistent/Qwen3-4B")
    assert m.num_params == pytest.approx(4.02e9, rel=0.01)  # model card: 4.0B
    assert m.kv_bytes_per_token == 2 * 36 * 8 * 128 * 2 == 147456
    acc = ACCELERATORS["h100"]
    assert kv_capacity_tokens(m, acc, 1, 0.8) == int((80e9 * 0.8 - m.num_params * 2) // 147456)
    with pytest.raises(ValueError, match="model.path"):
        model_spec("/nonexistent/Unknown-7B")


def test_decode_cost_against_hand_computation():
    m, acc = model_spec("/x/Qwen3-4B"), ACCELERATORS["h100"]
    cost = gpu_step_cost(m, acc, 1, 0.002, 0.8, 0.5)
    bw, fl = 3.35e12 * 0.8, 989.4e12 * 0.5
    rows, ctx = 64, 64 * 4000
    memory = (m.num_params * 2 + ctx * 147456) / bw
    compute = (2 * m.num_params * rows + 4 * 36 * 32 * 128 * ctx) / fl
    assert cost.step(rows, ctx) == pytest.approx(0.002 + max(memory, compute))
    # a span of n steps is the sum of its steps, each with `rows` more tokens of context
    n = 37
    assert cost.decode_span(rows, ctx, n) == pytest.approx(sum(cost.step(rows, ctx + rows * j) for j in range(n)))
    # where compute overtakes memory inside the span (a large batch of short rows), still exact
    big = StepCost(0.0, ((1.0, 0.0, 0.01), (3.0, 0.0, 0.0)), 0.0, 0.0)
    assert big.decode_span(1, 0.0, 500) == pytest.approx(sum(big.step(1, j) for j in range(500)))
    assert big.steps_within(1, 0.0, 500, big.decode_span(1, 0.0, 123)) == 123
    three = StepCost(0.001, ((1.0, 0.0, 0.01), (3.0, 0.0, 0.0), (0.0, 0.5, 0.02)), 0.0, 0.0)
    for rows, ctx, n in ((1, 0.0, 500), (3, 10.0, 77), (2, 400.0, 1)):
        assert three.decode_span(rows, ctx, n) == pytest.approx(sum(three.step(rows, ctx + rows * j) for j in range(n)))
    # the CPU engine's padded attention: its span grows by `rows` tokens a step, like the context
    padded = StepCost(0.0, ((0.001, 1e-4, 1e-6),), 0.0, 0.0, per_attended=2e-6)
    assert padded.step(4, 100.0, 256.0) == pytest.approx(0.001 + 4e-4 + 1e-4 + 2e-6 * 256)
    assert padded.decode_span(4, 100.0, 9, 256.0) == pytest.approx(
        sum(padded.step(4, 100.0 + 4 * j, 256.0 + 4 * j) for j in range(9)))
    assert padded.steps_within(4, 100.0, 9, padded.decode_span(4, 100.0, 5, 256.0), 256.0) == 5
    prefill = cost.admission([(0, 1000), (200, 300)])
    pairs = 1000 * 1001 / 2 + (300 * 301 - 200 * 201) / 2
    assert prefill == pytest.approx((1100 * 2 * m.num_params + pairs * 4 * 36 * 32 * 128) / fl)


def test_steps_within_is_the_bisection_over_every_step():
    """`steps_within` starts from a bound (the step cost's tangent at the first step) and costs one or two
    spans; it must give what a bisection over all n steps gives, for any mix of lines and padding."""
    rng = random.Random(7)

    def bisect(c, rows, ctx, n, seconds, att):
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if c.decode_span(rows, ctx, mid, att) <= seconds else (lo, mid - 1)
        return lo

    for _ in range(3000):
        terms = tuple((rng.choice([0.0, rng.uniform(0, 1e-2)]), rng.choice([0.0, rng.uniform(0, 1e-4)]),
                       rng.choice([0.0, rng.uniform(0, 1e-7), 10 ** rng.uniform(-30, -4)]))  # tiny slopes too
                      for _ in range(rng.choice([1, 2, 2, 3])))
        c = StepCost(rng.choice([0.0, rng.uniform(0, 1e-3)]), terms, 0.0, 0.0,
                     per_attended=rng.choice([0.0, rng.uniform(0, 1e-8)]))
        rows, ctx, n, att = rng.randint(1, 256), rng.uniform(0, 1e6), rng.randint(0, 20000), rng.uniform(0, 1e6)
        total = c.decode_span(rows, ctx, n, att)
        seconds = rng.choice([rng.uniform(0, 1.2 * total), c.decode_span(rows, ctx, rng.randint(0, n), att), 0.0])
        assert c.steps_within(rows, ctx, n, seconds, att) == bisect(c, rows, ctx, n, seconds, att), (terms, rows, n)
    c = StepCost(0.0, ((1e-2, 0.0, 1e-22),), 0.0, 0.0)  # a slope 1e-20 of the step: the bound keeps its digits
    assert c.steps_within(1, 0.0, 100, 0.1) == bisect(c, 1, 0.0, 100, 0.1, 0.0) == 10
    assert c.steps_within(1, 0.0, 100, math.inf) == 100 and c.steps_within(1, 0.0, 100, math.nan) == 0
