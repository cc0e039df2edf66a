"""The simulated engine (sim/engine.py): the Engine protocol's contract in virtual time, continuous
batching under its row cap, KV capacity and prefill budget, abort and resume, parked caches."""
import asyncio

import pytest

from april_ray.types import FinishReason, GenerateRequest, SamplingParams
from sim.clock import run_virtual
from sim.engine import SimEngine
from sim.hardware import StepCost

FLAT = StepCost(0.0, ((0.01, 0.0, 0.0),), 0.0, 0.0)
"""10 ms a step whatever the batch: a GPU's decode bound by reading the weights, in caricature."""


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


def test_a_caller_that_gives_up_frees_its_row():
    """A cancelled call (the worker's gather cancels a group's other samples when one fails) is aborted,
    as the real engines abort theirs: its row is free at the end of the step in progress."""
    async def main(loop):
        e = SimEngine(FLAT, Lengths(50), max_num_seqs=4, kv_capacity=10_000, max_prefill_tokens=1000)
        task = asyncio.ensure_future(e.generate(request("a@0")))
        await asyncio.sleep(0.105)
        task.cancel()
        await asyncio.sleep(0.02)
        return task.cancelled(), len(e.running), len(e.waiting), e.context

    assert run_virtual(main) == (True, 0, 0, 0)
