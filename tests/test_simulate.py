"""The simulator (sim/): virtual time, the simulated engine's contract, the cost model, the real
rollout on simulated engines, and `jobs.simulate`'s output."""
import asyncio
import json
import math
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from april_ray.config import Config, RolloutConfig, StalenessConfig
from sim.clock import SimulationStalled, VirtualLoop, run_virtual
from sim.cluster import CONTROL_PLANE, Schedule, Setting, saturated
from sim.engine import SimEngine
from sim.hardware import ACCELERATORS, StepCost, gpu_step_cost, kv_capacity_tokens, model_spec
from sim.workload import LengthModel, Workload
from april_ray.types import FinishReason, GenerateRequest, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
FLAT = StepCost(0.0, ((0.01, 0.0, 0.0),), 0.0, 0.0)
"""10 ms a step whatever the batch: a GPU's decode bound by reading the weights, in caricature."""


def real_waits(monkeypatch) -> list:
    """The timeouts the virtual loop passes to the real `select` (a wait for real, when positive)."""
    import selectors

    timeouts, select = [], selectors.SelectSelector.select

    def recording(self, timeout=None):
        timeouts.append(timeout)
        return select(self, timeout)

    monkeypatch.setattr(selectors.SelectSelector, "select", recording)
    return timeouts


def test_virtual_clock_jumps_instead_of_sleeping(monkeypatch):
    async def main(loop):
        t0 = loop.time()
        await asyncio.sleep(60.0)
        done, _ = await asyncio.wait([asyncio.ensure_future(asyncio.sleep(5.0))], timeout=30.0)
        return loop.time() - t0, len(done)

    waits = real_waits(monkeypatch)
    elapsed, done = run_virtual(main)
    assert elapsed == pytest.approx(65.0) and done == 1
    assert all(t is not None and t <= 0.01 for t in waits)  # never a wait for the timers' time


def test_virtual_clock_reports_a_deadlock_instead_of_hanging():
    async def main(loop):
        await loop.create_future()

    with pytest.raises(SimulationStalled):
        run_virtual(main)


def test_watched_cpu_is_charged_to_its_account_and_to_the_clock():
    async def busy():
        t = time.process_time()
        while time.process_time() - t < 0.02:
            pass

    async def main(loop):
        loop.clocked.add("cp")
        await loop.spawn(busy(), "cp")
        return loop.time(), loop.cpu["cp"]

    now, cpu = run_virtual(main)
    assert cpu >= 0.02 and now == pytest.approx(cpu)


# -- the cost model ------------------------------------------------------------------------------------
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


# -- the simulated engine ------------------------------------------------------------------------------
class Lengths:
    """Every request's response ends at `length` blocks (the prompt is one block)."""

    def __init__(self, length):
        self.length = length

    def __call__(self, key, input_ids):
        return self.length - (len(input_ids) - 1), 0


def request(rid, done=0, budget=100):
    return GenerateRequest(rid, [0] * (1 + done), SamplingParams(max_new_tokens=budget))


def test_engine_finishes_at_the_drawn_length_and_stamps_versions():
    async def main(loop):
        e = SimEngine(FLAT, Lengths(30), max_num_seqs=4, kv_capacity=10_000, max_prefill_tokens=1000, version=3)
        out = await e.generate(request("a@0"))
        return out, loop.time()

    out, now = run_virtual(main)
    assert out.finish_reason == FinishReason.STOP and out.num_tokens == 30 and out.versions == [3] * 30
    assert now == pytest.approx(0.30)


def test_abort_returns_partial_tokens_and_resume_continues_with_the_remaining_budget():
    async def main(loop):
        e = SimEngine(FLAT, Lengths(50), max_num_seqs=4, kv_capacity=10_000, max_prefill_tokens=1000)
        task = asyncio.ensure_future(e.generate(request("a@0", budget=60)))
        await asyncio.sleep(0.105)  # 10 steps done, the 11th in progress: it completes, then the abort
        assert e.abort("a@0") and not e.abort("unknown")
        first = await task
        e.update_weights(None, 1)
        second = await e.generate(request("a@1", done=first.num_tokens, budget=60 - first.num_tokens))
        return first, second

    first, second = run_virtual(main)
    assert first.finish_reason == FinishReason.ABORT and first.num_tokens == 11 and first.versions == [0] * 11
    assert second.finish_reason == FinishReason.STOP and second.num_tokens == 39 and second.versions == [1] * 39


def test_outputs_share_their_repeated_lists_and_a_resumed_sample_gets_lists_of_its_own(monkeypatch):
    """Outputs of the same length and version share one list each (read-only, as every message's lists
    are); a sample resumed on them gets new lists, leaving the shared ones as they were; the shared lists
    are let go past their bound, and lists made after that are equal."""
    import sim.engine as sim_engine
    from april_ray.types import Sample

    async def main(loop):
        e = SimEngine(FLAT, Lengths(30), max_num_seqs=4, kv_capacity=10_000, max_prefill_tokens=1000, version=2)
        a, b = await asyncio.gather(e.generate(request("a@0")), e.generate(request("b@0")))
        sample = Sample("s", "g", "", "", [0], 100)
        sample = sample.extended(a)
        e.update_weights(None, 3)
        more = await e.generate(request("s@1", done=10, budget=70))  # 20 blocks left, of version 3
        sample = sample.extended(more)
        return a, b, sample

    a, b, sample = run_virtual(main)
    assert a.token_ids is b.token_ids and a.logprobs is b.logprobs and a.versions is b.versions
    assert sample.versions == [2] * 30 + [3] * 20 and sample.versions is not a.versions
    assert a.versions == [2] * 30 and a.token_ids == [0] * 30 and a.logprobs == [-1.0] * 30
    for name, value in (("_MAX_REPEATED_ITEMS", 50), ("_repeated_items", 0), ("_REPEATED", {})):
        monkeypatch.setattr(sim_engine, name, value)
    kept = sim_engine.repeated(7, 40)
    assert sim_engine.repeated(7, 40) is kept
    assert sim_engine.repeated(8, 40) == [8] * 40 and sim_engine.repeated(7, 40) is not kept  # let go
    assert sim_engine.repeated(7, 40) == kept


def test_budget_ends_a_sample_with_reason_length():
    async def main(loop):
        e = SimEngine(FLAT, Lengths(500), max_num_seqs=4, kv_capacity=10_000, max_prefill_tokens=1000)
        return await e.generate(request("a@0", budget=40))

    out = run_virtual(main)
    assert out.finish_reason == FinishReason.LENGTH and out.num_tokens == 40


def test_kv_capacity_holds_requests_back_and_never_overflows():
    async def main(loop):
        e = SimEngine(FLAT, Lengths(100), max_num_seqs=64, kv_capacity=350, max_prefill_tokens=1000)
        outs = await asyncio.gather(*[e.generate(request(f"r{i}@0")) for i in range(8)])
        return e, outs

    e, outs = run_virtual(main)
    assert all(o.num_tokens == 100 and o.finish_reason == FinishReason.STOP for o in outs)
    assert e.peak_context <= 350
    assert e.num_retracted > 0  # 3 rows of 1 + 100 do not fit 350: the newest is retracted and waits


def test_running_rows_capped_and_parked_cache_skips_the_prefill():
    async def main(loop):
        e = SimEngine(FLAT, Lengths(40), max_num_seqs=2, kv_capacity=10_000, max_prefill_tokens=1000,
                      park_slots=4, max_versions=1)
        tasks = [asyncio.ensure_future(e.generate(request(f"s{i}@0"))) for i in range(3)]
        await asyncio.sleep(0.055)
        assert len(e.running) == 2 and len(e.waiting) == 1
        e.abort_all()
        outs = await asyncio.gather(*tasks)
        prefilled = e.num_prefill
        e.update_weights(None, 1)
        n = outs[0].num_tokens
        again = await e.generate(request(f"s0@1", done=n, budget=100 - n))
        return outs, again, e.num_prefill - prefilled, e.num_reused

    outs, again, prefilled, reused = run_virtual(main)
    assert [o.num_tokens for o in outs] == [6, 6, 0]
    assert again.num_tokens == 34 and prefilled == 0 and reused == 7 - 1  # the last input token is decoded


def test_requests_held_back_by_the_prefill_budget_join_at_the_next_step():
    """As the CPU engine's scheduler (and SGLang's) does: every step admits within its prefill budget, so
    a request that did not fit one step's budget joins at the next, not at the next finish."""
    async def main(loop):
        e = SimEngine(FLAT, Lengths(50), max_num_seqs=8, kv_capacity=10_000, max_prefill_tokens=10)
        tasks = [asyncio.ensure_future(e.generate(request(f"r{i}@0", done=5))) for i in range(3)]
        ends = []
        for t in tasks:
            await t
            ends.append(loop.time())
        return ends

    # 6 input blocks each, 10 a step: one request per step; each then has 45 blocks to go
    assert run_virtual(main) == pytest.approx([0.45, 0.46, 0.47])


def test_an_aborted_requests_finish_does_not_end_a_later_span():
    """A request that left early (aborted) keeps its entry in the finish heap; the next span must run to
    the next finish of a request still running, in one piece."""
    def target(key, input_ids):
        return (30 if key.startswith("s") else 100) - (len(input_ids) - 1), 0

    async def main(loop):
        e = SimEngine(FLAT, target, max_num_seqs=8, kv_capacity=10_000, max_prefill_tokens=1000)
        tasks = [asyncio.ensure_future(e.generate(request(f"s{i}@0"))) for i in range(4)]
        await asyncio.sleep(0.105)
        e.abort_all()
        await asyncio.gather(*tasks)  # their finishes (step 30) stay in the heap
        e.stats(drain=True)
        t0 = loop.time()
        out = await e.generate(request("l0@1"))
        return out, loop.time() - t0, e.stats().occupancy

    out, elapsed, spans = run_virtual(main)
    assert out.num_tokens == 100 and elapsed == pytest.approx(1.0)
    assert len(spans) == 1


def test_padded_attention_is_the_cpu_engines_over_rows_grouped_by_span_class():
    """With a `per_attended` cost the simulated engine pads each row to the longest context of its span
    class, as the CPU engine's decode segments do once its rows are grouped by class."""
    from april_ray.engine.model_runner import decode_segments

    cost = StepCost(0.0, ((0.001, 0.0, 0.0),), 0.0, 0.0, per_attended=1e-6)

    async def main(loop):
        e = SimEngine(cost, Lengths(500), max_num_seqs=8, kv_capacity=100_000, max_prefill_tokens=100_000)
        tasks = [asyncio.ensure_future(e.generate(request(f"r{i}@0", done=d, budget=600)))
                 for i, d in enumerate((5, 40, 62, 70, 200, 130))]
        await asyncio.sleep(0.0205)  # mid-span: nothing finishes before 300 steps
        positions = sorted(r.input_len + e.steps - r.start - 1 for r in e.running.values())
        attended = e._attended()
        e.abort_all()
        await asyncio.gather(*tasks)
        return positions, attended, e.span

    positions, attended, span = run_virtual(main)
    expected = sum((end - start) * width for start, end, width in decode_segments(positions))
    assert attended == expected and attended > sum(p + 1 for p in positions)  # three classes, padded
    assert span is None


def test_parked_caches_past_the_staleness_bound_free_their_slots():
    async def main(loop):
        e = SimEngine(FLAT, Lengths(40), max_num_seqs=2, kv_capacity=10_000, max_prefill_tokens=1000,
                      park_slots=4, max_versions=1)
        task = asyncio.ensure_future(e.generate(request("s0@0")))
        await asyncio.sleep(0.055)
        e.abort_all()
        await task
        counts = [len(e.parked)]
        for version in (1, 2):
            e.update_weights(None, version)
            await asyncio.sleep(0.01)
            counts.append(len(e.parked))
        return counts

    assert run_virtual(main) == [1, 1, 0]


# -- the real rollout on simulated engines --------------------------------------------------------------
def small_setting(cost=FLAT, engines=2, lengths=None, block=1, max_len=400, staleness=None) -> Setting:
    lengths = lengths or LengthModel("lognormal", 40, 1.0, 0.5, seed=0)
    wl = Workload(lengths, [8] * 500, block, max_len)
    return Setting(wl, cost, engines, 16, 100_000, 4096, staleness or StalenessConfig(4, "keep"))


def rollout(n=4, factor=None, dynamic_filter=False):
    return RolloutConfig(rollout_batch_size=n, over_sampling_batch_size=n if factor is None else int(factor * n),
                         n_samples_per_prompt=4, schedule="april" if factor is not None else "sync", dynamic_filter=dynamic_filter)


@pytest.mark.parametrize("factor", [None, 1.0, 2.0])
def test_accounting_invariant_after_every_simulated_step(factor):
    async def main(loop):
        loop.clocked.add(CONTROL_PLANE)
        s = Schedule("x", small_setting(), rollout(factor=factor, dynamic_filter=True), loop)
        for step in range(10):
            await s.step(step, measured=True)  # asserts: taken = returned + dropped + stored
            assert sum(e.running.__len__() + len(e.waiting) for e in s.engines) == 0
        return s

    s = run_virtual(main)
    summary = s.summary(1.0)
    assert summary["duplicated_samples"] == 0 and summary["samples_with_wrong_length"] == 0
    assert s.monitor.num_returned_groups == 40 and s.monitor.num_dropped_groups == 0
    if factor:
        assert summary["off_policy_token_ratio"] > 0 and s.store.partial


def test_a_filtered_share_of_prompts_is_dropped_by_the_real_filter_and_refilled():
    async def main(loop):
        wl = Workload(LengthModel("lognormal", 20, 0.5, 0.5, 0), [8] * 500, 1, 200, filtered_fraction=0.3)
        setting = Setting(wl, FLAT, 2, 16, 100_000, 4096, StalenessConfig(4, "keep"))
        s = Schedule("x", setting, rollout(factor=2.0, dynamic_filter=True), loop)
        for step in range(6):
            await s.step(step, measured=True)
        return s

    s = run_virtual(main)
    assert s.monitor.num_returned_groups == 24 and s.monitor.num_dropped_groups > 0


def test_flat_step_cost_leaves_sync_far_below_april():
    """A step that costs the same at any batch (a GPU bound by its weights): the draining synchronous
    batch wastes most of it, APRIL keeps it full."""

    def util(factor):
        async def main(loop):
            setting = small_setting(engines=1, lengths=LengthModel("lognormal", 40, 1.0, 0.5, seed=1))
            ceiling = await saturated(setting, loop, 4)
            s = Schedule("x", setting, rollout(n=4, factor=factor), loop)
            await s.run(8, 3)
            return s.summary(ceiling)["utilization"]

        return run_virtual(main)

    sync, april = util(None), util(2.0)
    assert sync < 0.45 and april > sync + 0.25


def test_sixty_virtual_seconds_of_rollout_run_on_the_virtual_clock():
    """A minute of APRIL rollout on the virtual clock: the steps' walls add up to the clock's time (no step
    waited for real), and every step's accounting holds (`Schedule.step` asserts it)."""
    async def main(loop):
        s = Schedule("x", small_setting(), rollout(factor=2.0), loop)
        while loop.time() < 60.0:
            await s.step(len(s.records), measured=True)
        return s, loop.time()

    s, now = run_virtual(main)
    assert now >= 60.0 and len(s.records) >= 3
    assert sum(r.wall_s for r in s.records) == pytest.approx(now, rel=1e-6)
    assert s.summary(1.0)["duplicated_samples"] == s.summary(1.0)["samples_with_wrong_length"] == 0


def test_tokens_the_learners_staleness_mask_drops_do_not_count_as_throughput():
    """Under staleness.policy mask, tokens older than max_versions reach the learner and are masked out of
    the loss: the simulated throughput leaves them out (`unmasked_*`); under keep every token counts."""
    def summary(policy):
        async def main(loop):
            s = Schedule("x", small_setting(staleness=StalenessConfig(1, policy)), rollout(factor=3.0), loop)
            await s.run(8, 2)
            return s.summary(1.0)

        return run_virtual(main)

    masked, kept = summary("mask"), summary("keep")
    assert kept["masked_token_ratio"] == 0 and kept["unmasked_tok_s"] == kept["effective_tok_s"]
    ages = {int(a): share for a, share in masked["staleness_hist"].items()}
    assert masked["masked_token_ratio"] > 0
    assert masked["masked_token_ratio"] == pytest.approx(sum(v for a, v in ages.items() if a > 1), abs=1e-3)
    assert masked["unmasked_tok_s"] == pytest.approx(masked["effective_tok_s"] * (1 - masked["masked_token_ratio"]))


def test_a_step_served_whole_from_the_stores_surplus_is_timed_on_the_virtual_clock():
    """Short responses and N'/N = 4: some steps find N complete groups in the store and dispatch nothing;
    on the virtual clock such a step lasts the monitor's CPU (no division by a zero wall)."""
    async def main(loop):
        loop.clocked.add(CONTROL_PLANE)
        lengths = LengthModel("histogram", 1, 1.0, 0.0, seed=0, histogram=[2, 3, 4])
        s = Schedule("x", small_setting(lengths=lengths), rollout(n=2, factor=4.0), loop)
        await s.run(6, 0)
        return s, loop.time()

    s, now = run_virtual(main)
    assert any(r.generated == 0 for r in s.records)  # served from the surplus
    assert all(r.wall_s > 0 for r in s.records) and sum(r.wall_s for r in s.records) == pytest.approx(now)


def test_bad_input_to_the_simulator_names_the_flag_or_the_entry(tmp_path):
    import argparse

    from sim.config import number_list
    from sim.workload import load_lengths_file

    path = tmp_path / "lengths.json"
    for content, where in [({"lengths": [1, 2, "x"]}, "lengths[2]"), ({"lengths": [5, 0]}, "lengths[1]"),
                           ({"by_row": {"3": [5, 2.5]}}, "by_row['3'][1]"), ({"by_row": {"a": [1]}}, "by_row key 'a'"),
                           ({"by_row": {"3": 5}}, "by_row['3']"), ([1, 2], "expected an object")]:
        path.write_text(json.dumps(content))
        with pytest.raises(ValueError, match=re.escape(f"response lengths file {path}: {where}")):
            load_lengths_file(str(path))
    path.write_text(json.dumps({"by_row": {"3": [5, 6]}, "lengths": [100, 200]}))
    assert load_lengths_file(str(path)) == ([100, 200], {3: [5, 6]})

    class Parser(argparse.ArgumentParser):
        def error(self, message):
            raise ValueError(message)

    gpus = dict(kind=int, ok=lambda g: g >= 2 and g % 2 == 0, rule="multiples of 2")
    assert number_list(Parser(), "--gpus", "8,16", **gpus) == [8, 16]
    for text, message in [("8,x", "--gpus 8,x: expected comma-separated int"), ("8,7,0", "--gpus: 7, 0: expected")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            number_list(Parser(), "--gpus", text, **gpus)
    for workers, message in [("x", "--workers x: expected a number of processes or auto"),
                             ("0", "--workers 0: must be at least 1")]:
        proc = subprocess.run([sys.executable, "-m", "jobs.simulate", "--config", "configs/qwen3_4b_dapo.yaml",
                               "--workers", workers], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


# -- the job ---------------------------------------------------------------------------------------------
def test_usable_cores_follow_the_affinity_and_the_lowest_cpu_quota_on_the_cgroups_path(tmp_path):
    from jobs.common import usable_cores

    affinity = len(os.sched_getaffinity(0))
    proc = tmp_path / "cgroup"
    proc.write_text("0::/\n")
    assert usable_cores(str(tmp_path / "none"), str(proc)) == affinity  # nothing readable: the affinity alone
    assert usable_cores(str(tmp_path / "none"), str(tmp_path / "no-proc-file")) == affinity
    v2 = tmp_path / "v2"
    v2.mkdir()
    for text, cores in [("max 100000\n", affinity), ("150000 100000\n", min(affinity, 2)),
                        ("50000 100000\n", 1), ("garbage\n", affinity), ("100000 0\n", affinity)]:
        (v2 / "cpu.max").write_text(text)  # a container's own cgroup, seen at the root
        assert usable_cores(str(v2), str(proc)) == cores, text
    # v2, a unit's cgroup below the root: its own quota and its parents' count, the lowest wins
    (v2 / "cpu.max").unlink()
    unit = v2 / "system.slice" / "job.service"
    unit.mkdir(parents=True)
    proc.write_text("0::/system.slice/job.service\n")
    (unit / "cpu.max").write_text("max 100000\n")
    assert usable_cores(str(v2), str(proc)) == affinity
    (unit.parent / "cpu.max").write_text("100000 100000\n")
    assert usable_cores(str(v2), str(proc)) == 1
    # v1: the cpu controller's hierarchy, the path from /proc/self/cgroup, or the root when not there
    v1 = tmp_path / "v1" / "cpu"
    (v1 / "batch").mkdir(parents=True)
    for d in (v1, v1 / "batch"):
        (d / "cpu.cfs_period_us").write_text("100000\n")
        (d / "cpu.cfs_quota_us").write_text("-1\n")
    proc.write_text("4:memory:/batch\n3:cpu,cpuacct:/batch\n")
    for where, quota, cores in [(v1 / "batch", "250000", min(affinity, 3)), (v1, "100000", 1)]:
        (where / "cpu.cfs_quota_us").write_text(quota + "\n")
        assert usable_cores(str(tmp_path / "v1"), str(proc)) == cores, (where, quota)
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    proc.write_text("3:cpu,cpuacct:/docker/0123abcd\n")  # a container's host path, not under its mount
    assert usable_cores(str(tmp_path / "v1"), str(proc)) == affinity
    (tmp_path / "cpu.max").write_text("100000 100000\n")  # outside the mount: never read
    (tmp_path / "cpu.cfs_quota_us").write_text("100000\n")
    (tmp_path / "cpu.cfs_period_us").write_text("100000\n")
    mount = tmp_path / "m" / "n"
    (mount / "cpu").mkdir(parents=True)
    for text in ("0::/../..\n", "3:cpu:/../../..\n"):
        proc.write_text(text)
        assert usable_cores(str(mount), str(proc)) == affinity
    proc.write_bytes(b"0::/\xff\xfe\n")  # not UTF-8: no quota read, no error
    assert usable_cores(str(v2), str(proc)) == affinity


def test_bench_simulation_counts_the_calls_each_schedule_makes():
    """`jobs.bench.simulation`'s per-call figures rest on its counts: sync sends every sample of its N
    groups once a step (nothing is filtered here); APRIL sends more (resumes), and one span ends per event;
    the worker alone sends each sample of each round's groups once."""
    from jobs.bench.simulation import schedule_cost, worker_alone
    from april_ray.config import load_config
    from sim import study
    from sim.config import load_simulate_config

    cfg = load_config(str(ROOT / "configs/qwen3_4b_dapo.yaml"), ["sampling.max_response_len=2048"])
    sim = load_simulate_config(["simulate.length_median=300"])
    sync = schedule_cost(cfg, sim, 8, None, steps=2, warmup=0)
    april = schedule_cost(cfg, sim, 8, 2.0, steps=2, warmup=1)
    assert sync["sample_calls_per_step"] == 32 * 8
    assert april["sample_calls_per_step"] > 32 * 8
    for r in (sync, april):
        assert 0 < r["spans_per_call"] <= 2 and r["control_plane_us_per_call"] > 0 and r["rest_us_per_call"] > 0
    alone = worker_alone(study.gpu_setting(cfg, sim, 8), groups=16, n_samples=8, rounds=2)
    assert alone["sample_calls"] == 2 * 16 * 8 and alone["us_per_call"] > 0


def test_bench_simulation_counts_the_same_python_operations_in_every_run():
    """`--ops`: a schedule's Python operations per sample call, counted by a tracer, are the same from one
    run to the next (what makes them a measure free of timing noise), and are charged to the files that
    ran them: the rollout's own code and the simulator's."""
    from jobs.bench.simulation import schedule_ops
    from april_ray.config import load_config
    from sim.config import load_simulate_config

    cfg = load_config(str(ROOT / "configs/qwen3_4b_dapo.yaml"), ["sampling.max_response_len=2048"])
    sim = load_simulate_config(["simulate.length_median=300"])
    first, again = (schedule_ops(cfg, sim, 8, 2.0, steps=1, warmup=1, schedule="april") for _ in range(2))
    assert first == again
    assert first["sample_calls"] > 32 * 8 and first["ops_per_call"] > first["python_calls_per_call"] > 1
    files = first["ops_per_call_by_file"]
    assert files["april_ray/rollout/monitor.py"] > 0 and files["sim/engine.py"] > 0
    assert sum(files.values()) == pytest.approx(first["ops_per_call"], rel=1e-3)


def test_jobs_simulate_writes_the_promised_keys(tmp_path):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    cmd = [sys.executable, "-m", "jobs.simulate", "--config", "configs/qwen3_4b_dapo.yaml", "--gpus", "8,16",
           "--factors", "1,2", "--json", str(out), "--plot", str(png), "simulate.steps=2", "simulate.warmup_steps=1",
           "simulate.length_median=300", "sampling.max_response_len=2048", "engine.max_model_len=3072"]
    proc = subprocess.run([*cmd, "--workers", "1"], check=True, capture_output=True, text=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["workers"] == 1 and proc.stdout.rstrip().endswith("of CPU in 1 process")
    assert {"wall_s", "assumptions", "results"} <= result.keys() and png.stat().st_size > 0
    assert len(result["results"]) == 4
    for row in result["results"]:
        assert {"gpus", "factor", "sync_utilization", "april_utilization", "speedup", "off_policy_token_ratio",
                "step_s", "control_plane_cpu_s_per_step"} <= row.keys()
        assert 0 < row["sync_utilization"] <= 1.05 and 0 < row["april_utilization"] <= 1.05
        # the over-provisioned baseline throws away what is unfinished at the N-th group; at N'/N = 1 it is sync
        if row["factor"] == 1:
            assert row["oversample_utilization"] == row["sync_utilization"] and row["oversample_sim_cpu_s"] == 0
        else:
            assert 0 < row["oversample_utilization"] <= 1.05 and row["oversample_generated_per_trained"] > 1
        assert row["sample_speedup_vs_oversample"] > 0 and row["speedup_vs_oversample"] > 0
        assert row["lost_groups"] == row["duplicated_samples"] == row["samples_with_wrong_length"] == 0
        assert math.isfinite(row["step_s"]) and row["step_s"] > 0
    assert result["assumptions"]["accelerator"]["bandwidth"] == 3.35e12
    # side by side in two processes, and by default in a process per usable core (at most one per schedule:
    # 8 here): the same schedules (the control plane's measured CPU, which passes on the virtual clock, moves
    # the figures by a hair)
    from jobs.common import usable_cores

    sides = []
    for workers, expected in [(["--workers", "2"], 2), ([], min(8, usable_cores()))]:
        both = tmp_path / f"side{expected}.json"
        subprocess.run([*cmd[:cmd.index("--json") + 1], str(both), *cmd[cmd.index("--plot") + 2:], *workers],
                       check=True, capture_output=True, text=True, timeout=300)
        sides.append(json.loads(both.read_text()))
        assert sides[-1]["workers"] == expected and len(sides[-1]["results"]) == len(result["results"]) == 4
    for a, b in ((a, b) for side in sides for a, b in zip(result["results"], side["results"])):
        assert (a["gpus"], a["factor"], a["rollout_batch_size"]) == (b["gpus"], b["factor"], b["rollout_batch_size"])
        assert a["off_policy_token_ratio"] == pytest.approx(b["off_policy_token_ratio"], abs=0.02)
        for key in ("sync_utilization", "april_utilization", "speedup"):  # ~0.1% apart on a quiet machine
            assert a[key] == pytest.approx(b[key], rel=0.03), key
    # no more processes than schedules (here 2: sync, and APRIL at N'/N = 1), and a bad count named
    from jobs.simulate import simulate_gpus
    from april_ray.config import load_config
    from sim.config import load_simulate_config

    small = load_config(str(ROOT / "configs/qwen3_4b_dapo.yaml"), ["sampling.max_response_len=2048"])
    sim = load_simulate_config(["simulate.steps=1", "simulate.warmup_steps=0", "simulate.length_median=300"])
    assert simulate_gpus(small, sim, [8], [1.0], workers=4)["workers"] == 2
    with pytest.raises(ValueError, match="workers: expected a number of processes of at least 1 or 'auto', got 0"):
        simulate_gpus(small, sim, [8], [1.0], workers=0)


@pytest.mark.slow
def test_calibrate_compares_the_simulation_with_both_measurements(tmp_path, random_model_dir):
    """`--calibrate` on the committed measurements: every mode compared in wall-clock and CPU time, the
    simulated schedules lose nothing (the tokenizer is a random model's, so only the keys are checked)."""
    out = tmp_path / "cal.json"
    cmd = [sys.executable, "-m", "jobs.simulate", "--config", "configs/tiny_cpu.yaml", "--calibrate", "--json",
           str(out), f"model.path={random_model_dir}", f"model.cache_dir={tmp_path}", "task.num_train=2000"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["mode"] for r in result["comparison"]] == ["sync", "april_1.5", "april_3"]
    for r in result["comparison"]:
        assert 0 < r["simulated_utilization"] <= 1.05 and r["error"] == pytest.approx(
            r["simulated_utilization"] - r["measured_utilization"])
        assert r["in_situ_utilization"] is not None and r["duplicated_samples"] == r["samples_with_wrong_length"] == 0
        if r["measured_cpu_utilization"] is not None:
            assert r["cpu_error"] == pytest.approx(r["simulated_utilization"] - r["measured_cpu_utilization"])
        assert r["bench_probe_error"] == pytest.approx(r["simulated_vs_bench_probe"] - r["measured_utilization"])
        assert r["replayed_error"] == pytest.approx(r["replayed_vs_bench_probe"] - r["measured_utilization"])
        assert r["simulated_vs_bench_probe"] < r["simulated_utilization"]  # a restarted probe runs short contexts
        # the committed bench run carries its own step costs; the recording's are the cross-check
        assert r["recording_costs_error"] == pytest.approx(r["recording_costs_vs_bench_probe"] - r["measured_utilization"])
        assert r["measured_attended_per_context"] >= 1 and r["simulated_attended_per_context"] >= 1
    assert result["setup"]["costs_from"] == "the bench run's own engine steps"
    assert {"within_0.05", "within_0.05_cpu", "within_0.05_in_situ", "within_0.05_bench_probe",
            "within_0.05_replayed"} <= result.keys()
    assert result["ceiling_tok_s"]["simulated_bench_probe"] > result["ceiling_tok_s"]["simulated"]
    assert set(result["fit_over_measured_steps"]) == {"sync", "april_1.5", "april_3", "probe"}


def test_fit_over_measured_is_one_for_exact_costs_and_finds_a_mode_they_miss():
    """Steps that follow the fitted costs exactly give 1; a mode whose steps all cost 10% more than their
    features say gives 1/1.1, and the fit from every mode's steps is what `fit_costs` returns."""
    from sim.calibrate import COSTS, FEATURES, fit_costs, fit_over_measured

    rng = np.random.default_rng(0)
    true = dict(zip(COSTS, (1e-3, 4e-5, 3e-7, 2e-5, 2e-4, 0.0, 2e-6, 6e-4, 3e-7)))

    def steps(n: int, extra: float) -> list[tuple]:
        out = []
        for _ in range(n):
            rows, ctx = int(rng.integers(1, 65)), float(rng.integers(100, 5000))
            pre = float(rng.integers(0, 200)) * (rng.random() < 0.3)
            x = (1.0, rows, ctx, pre, float(pre > 0), float(rng.integers(0, 3)), float(rng.integers(0, 50)),
                 float(rng.random() < 0.05), ctx * (1 + rng.random()))
            out.append(x + (extra * sum(true[c] * v for c, v in zip(COSTS, x)),))
        return out

    recorded = {"sync": steps(400, 1.0), "probe": steps(400, 1.0), "april_3": steps(40, 1.1)}
    fit = fit_costs([r for rs in recorded.values() for r in rs])
    sums = {m: dict(zip(FEATURES + ("cpu_s",), map(float, np.sum(rs, axis=0)))) for m, rs in recorded.items()}
    ratio = fit_over_measured({"step_costs": {"fit": fit, "sums": sums}})
    assert ratio["sync"] == pytest.approx(1.0, abs=0.01) and ratio["probe"] == pytest.approx(1.0, abs=0.01)
    assert ratio["april_3"] == pytest.approx(1 / 1.1, abs=0.02)
    exact = {"step_costs": {"fit": true, "sums": {m: s for m, s in sums.items() if m != "april_3"}}}
    assert fit_over_measured(exact) == pytest.approx({"sync": 1.0, "probe": 1.0})
    assert fit_over_measured({}) == {}


def test_fit_by_gap_finds_steps_that_follow_other_work_costlier():
    """Steps that follow over a millisecond of other work cost 20% more than their batch: their bin's fit
    over measured is 1/1.2, the rest's 1; bins of fewer than 20 steps are left out."""
    from sim.calibrate import COSTS, fit_by_gap

    fit = dict(zip(COSTS, (1e-3, 4e-5, 3e-7, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)))
    rows, gaps = [], []
    for i in range(300):
        gap = (0.1e-3, 2e-3, 50e-3)[i % 3] if i < 290 else 0.01e-3  # 10 steps in the first bin: left out
        x = (1.0, float(1 + i % 64), float(100 * (1 + i % 50)), 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        cost = sum(fit[c] * v for c, v in zip(COSTS, x)) * (1.2 if gap > 1e-3 else 1.0)
        rows.append(x + (cost,))
        gaps.append(gap)
    bins = fit_by_gap(fit, {"april": rows}, {"april": gaps})["april"]
    assert [b["gap_ms"] for b in bins] == [[0.05, 0.2], [1.0, 5.0], [5.0, None]]
    assert [round(b["fit_over_measured"], 3) for b in bins] == [1.0, round(1 / 1.2, 3), round(1 / 1.2, 3)]
    assert sum(b["steps"] for b in bins) == 290


@pytest.mark.slow
def test_measure_cpu_takes_its_costs_from_a_bench_run_and_calibrate_reads_them(tmp_path, random_model_dir):
    """`--measure-cpu` runs jobs.bench.schedule for the step costs, times the grid, records the lengths;
    `--calibrate` with those costs and a bench JSON that has none of its own uses them."""
    costs = tmp_path / "cpu.json"
    small = [f"model.path={random_model_dir}", f"model.cache_dir={tmp_path}", "task.num_train=2000",
             "sampling.max_response_len=24"]
    cmd = [sys.executable, "-m", "jobs.simulate", "--config", "configs/tiny_cpu.yaml", "--measure-cpu", str(costs),
           "--record-steps", "4", "--probe-seconds", "0.3", *small]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(costs.read_text())
    assert measured["fit"]["steps"] > 0 and measured["grid_fit"]["c"] >= 0 and len(measured["by_row"]) == 320
    assert set(measured["in_situ"]) == {"sync", "april_1.5", "april_3"}
    assert all(0 < m["utilization"] for m in measured["in_situ"].values())
    assert measured["schedules"]["sync"]["steps"] == 4 and "step_costs" not in measured["schedules"]
    bench = json.loads((ROOT / "tests/data/bench_schedule_s7_r8.json").read_text())  # no step costs
    old = tmp_path / "bench.json"
    old.write_text(json.dumps(bench))
    out = tmp_path / "cal.json"
    cmd = [sys.executable, "-m", "jobs.simulate", "--config", "configs/tiny_cpu.yaml", "--calibrate", "--cpu-costs",
           str(costs), "--measured", str(old), "--json", str(out), *small]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["setup"]["costs_from"] == "the --measure-cpu recording" and result["setup"]["fit"] == measured["fit"]
    assert all(r["in_situ_utilization"] == measured["in_situ"][r["mode"]]["utilization"] for r in result["comparison"])


def test_a_thread_of_its_own_delays_only_the_clock_jumps(monkeypatch):
    """While a thread started during the simulation lives (it could post a result), the loop waits for
    real before jumping the clock, but not on the iterations that have callbacks ready: 1,000 of those
    cost no waiting."""
    import threading

    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, daemon=True)

    async def main(loop):
        thread.start()
        for _ in range(1000):
            await asyncio.sleep(0)
        return loop.time()

    waits = real_waits(monkeypatch)
    try:
        assert run_virtual(main) == 0.0
        assert len(waits) >= 1000 and all(t == 0 for t in waits)  # every ready iteration polls, none waits
    finally:
        stop.set()
        thread.join()


def test_a_result_posted_by_a_thread_of_its_own_arrives_before_the_clock_jumps():
    """A thread started during the simulation posts its result after a real delay, while the next timer
    is an hour away: the loop waits for it rather than jumping the clock (the result arrives at virtual
    time 0, and before the timer)."""
    import threading
    import time

    async def main(loop):
        fut = loop.create_future()
        timer = asyncio.ensure_future(asyncio.sleep(3600.0))
        threading.Thread(target=lambda: (time.sleep(0.2), loop.call_soon_threadsafe(fut.set_result, loop.time())),
                         daemon=True).start()
        posted_at = await fut
        return posted_at, loop.time(), timer.done()

    assert run_virtual(main) == (0.0, 0.0, False)


def test_an_executor_call_on_a_thread_older_than_the_loop_is_waited_for():
    """Work handed by `run_in_executor` to a pool whose thread was alive before the loop was made: the
    loop waits for its result rather than jumping the clock to the next timer."""
    import concurrent.futures
    import time

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: None).result()  # its one thread starts now, before the loop

        async def main(loop):
            timer = asyncio.ensure_future(asyncio.sleep(3600.0))
            await loop.run_in_executor(pool, time.sleep, 0.2)
            return loop.time(), timer.done(), loop.executor_calls

        assert run_virtual(main) == (0.0, False, 0)


def test_threads_alive_before_the_loop_hold_nothing_up(monkeypatch):
    """Threads that were alive when the loop was made (a notebook kernel's, a progress bar's monitor) are
    not the simulation's: a day of virtual sleeps makes no real wait and no system call to wait in."""
    import threading

    stop = threading.Event()
    threads = [threading.Thread(target=stop.wait, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()

    async def main(loop):
        for _ in range(24):
            await asyncio.sleep(3600.0)
        return loop.time()

    waits = real_waits(monkeypatch)
    try:
        assert run_virtual(main) == 24 * 3600.0
        assert waits == []
    finally:
        stop.set()
        for t in threads:
            t.join()
