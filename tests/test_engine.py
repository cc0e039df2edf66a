import asyncio
import os

import pytest
import torch

from april_ray.engine.async_engine import AsyncEngine
from april_ray.engine.cpu_engine import LLMEngine
from april_ray.types import FinishReason, GenerateRequest, SamplingParams

# Mixed lengths: the 90-character prompt puts decode rows in different span buckets.
PROMPTS = ["0052-3:", "12-1:", "0999-2: 0997", "7-1:", "hello world", "0153-3: 0150 0147 0144", "0321-1:" + " 0320" * 17]


def greedy(n=24):
    return SamplingParams(temperature=0.0, max_new_tokens=n)


def hf_greedy(model, ids, n):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def reference(random_model_dir):
    """`hf_greedy` of the same weights, from a model of its own (an engine may change its model's weights).
    Greedy continuations of one input are prefixes of one another, so each input is generated once, at
    the longest length any test here asks for, and cut to `n`."""
    from april_ray.model import load_policy

    model, _ = load_policy(random_model_dir)
    longest, cache = 40, {}

    def greedy_ids(ids, n):
        assert n <= longest
        if tuple(ids) not in cache:
            cache[tuple(ids)] = hf_greedy(model, ids, longest)
        return cache[tuple(ids)][:n]

    return greedy_ids


def requests(tok, sp, prompts=PROMPTS):
    return [GenerateRequest(f"r{i}", tok.encode(p), sp) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("max_num_seqs", [2, 8])
def test_greedy_matches_hf_generate_with_requests_joining_mid_batch(policy, max_num_seqs, reference):
    model, tok = policy
    # 2 slots for 7 requests: requests join as others leave, at token granularity
    engine = LLMEngine(model, max_num_seqs=max_num_seqs, max_model_len=128)
    outs = engine.generate(requests(tok, greedy()))
    for p, out in zip(PROMPTS, outs):
        assert out.token_ids == reference(tok.encode(p), 24), p
        assert out.finish_reason == FinishReason.LENGTH


def test_prefill_in_the_decode_pass_with_several_chunks_and_first_token_finishes(policy, reference):
    """Fresh inputs are prefilled in the running batch's decode pass; admissions over the prefill budget
    run in extra chunks first, and a request done at its first token leaves mid-step. Every continuation
    is still the model's own greedy one, and no row is fed twice in a step."""
    model, tok = policy
    engine = LLMEngine(model, max_num_seqs=8, max_model_len=160, max_prefill_tokens=24)
    first = requests(tok, greedy(30), PROMPTS[:2])
    for r in first:
        engine.add_request(r)
    engine.step()  # two rows running when the others arrive
    later = [GenerateRequest(f"late{i}", tok.encode(p), greedy(1 if i % 2 else 12)) for i, p in enumerate(PROMPTS)]
    for r in later:
        engine.add_request(r)
    outs = {}
    steps = 0
    while engine.has_work():
        for out in engine.step():
            outs[out.request_id] = out
        steps += 1
    for r in first:
        assert outs[r.request_id].token_ids == reference(r.input_ids, 30)
    for i, r in enumerate(later):
        assert outs[r.request_id].token_ids == reference(r.input_ids, r.sampling.max_new_tokens), PROMPTS[i]
    assert 1 + steps == 30  # the first two got one token a step, from their prefill on, and outlived the rest


def test_prefill_chunks_keep_fresh_prompts_apart_from_long_resumed_inputs():
    from april_ray.batching import padded_chunks

    lengths = [10] * 19 + [300, 12, 290, 600]
    assert [len(c) for c in padded_chunks(lengths, 8192)] == [22, 1]  # budget only: 22 rows padded to 300
    chunks = padded_chunks(lengths, 8192, max_spread=2.0)
    assert [sorted(lengths[i] for i in c) for c in chunks] == [[10] * 19 + [12], [290, 300], [600]]
    assert sorted(i for c in chunks for i in c) == list(range(len(lengths)))


def test_staggered_join_does_not_disturb_running_request(policy, reference):
    model, tok = policy
    engine = LLMEngine(model, max_num_seqs=4, max_model_len=128)
    engine.add_request(GenerateRequest("a", tok.encode(PROMPTS[0]), greedy(30)))
    done = {}
    for i in range(40):
        if i in (3, 7, 11):
            engine.add_request(GenerateRequest(f"b{i}", tok.encode(PROMPTS[i % 5 + 1]), greedy(5)))
        done.update({o.request_id: o for o in engine.step()})
    assert done["a"].token_ids == reference(tok.encode(PROMPTS[0]), 30)
    for i in (3, 7, 11):
        assert done[f"b{i}"].token_ids == reference(tok.encode(PROMPTS[i % 5 + 1]), 5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_a_separate_forward_pass(policy, temperature):
    model, tok = policy
    engine = LLMEngine(model, max_num_seqs=8, max_model_len=128, seed=1)
    outs = engine.generate(requests(tok, SamplingParams(temperature=temperature, max_new_tokens=20)))
    for p, out in zip(PROMPTS, outs):
        ids = tok.encode(p)
        full = torch.tensor([ids + out.token_ids])
        with torch.no_grad():
            logits = model(full).logits[0, len(ids) - 1 : -1] / temperature
        ref = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=1e-4)


def test_abort_returns_exact_prefix_and_resume_continues(policy, reference):
    model, tok = policy
    ids = tok.encode(PROMPTS[2])
    full = reference(ids, 40)
    engine = LLMEngine(model, max_num_seqs=4, max_model_len=128)
    engine.add_request(GenerateRequest("x", ids, greedy(40)))
    engine.add_request(GenerateRequest("other", tok.encode(PROMPTS[1]), greedy(40)))
    for _ in range(9):
        engine.step()
    part = engine.abort("x")
    assert part.finish_reason == FinishReason.ABORT
    assert 0 < len(part.token_ids) < 40 and part.token_ids == full[: len(part.token_ids)]
    assert len(part.logprobs) == len(part.versions) == len(part.token_ids)
    assert engine.abort("x") is None  # idempotent: already gone
    remaining = 40 - len(part.token_ids)
    [rest] = engine.generate([GenerateRequest("x2", ids + part.token_ids, greedy(remaining))])
    assert part.token_ids + rest.token_ids == full
    assert len(rest.token_ids) == remaining


def test_abort_all_returns_every_request_including_waiting(policy):
    model, tok = policy
    engine = LLMEngine(model, max_num_seqs=2, max_model_len=128)
    for r in requests(tok, greedy(50)):
        engine.add_request(r)
    engine.step()
    outs = engine.abort_all()
    assert sorted(o.request_id for o in outs) == [f"r{i}" for i in range(len(PROMPTS))]
    assert all(o.finish_reason == FinishReason.ABORT for o in outs)
    assert sum(len(o.token_ids) > 0 for o in outs) == 2  # the two running ones had tokens; waiting had none
    assert not engine.has_work()


def test_stop_token_and_budget_clamped_to_context(policy, reference):
    model, tok = policy
    engine = LLMEngine(model, max_num_seqs=4, max_model_len=32)
    ids = tok.encode(PROMPTS[0])
    first = reference(ids, 3)
    [stopped] = engine.generate([GenerateRequest("s", ids, SamplingParams(0.0, max_new_tokens=20,
                                                                         stop_token_ids=(first[2],)))])
    assert stopped.finish_reason == FinishReason.STOP and stopped.token_ids[-1] == first[2]
    assert len(stopped.token_ids) <= 3
    [clamped] = engine.generate([GenerateRequest("c", ids, greedy(1000))])
    assert clamped.finish_reason == FinishReason.LENGTH and len(ids) + len(clamped.token_ids) == 32


def test_top_k_1_and_tiny_top_p_are_greedy(policy):
    model, tok = policy
    engine = LLMEngine(model, max_num_seqs=8, max_model_len=128, seed=5)
    ref = engine.generate(requests(tok, greedy(16)))
    for sp in (SamplingParams(1.0, top_k=1, max_new_tokens=16), SamplingParams(1.0, top_p=1e-6, max_new_tokens=16)):
        outs = engine.generate(requests(tok, sp))
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def test_weight_update_stamps_new_version(policy, random_model_dir):
    model, tok = policy
    engine = LLMEngine(model, max_num_seqs=4, max_model_len=128)
    engine.add_request(GenerateRequest("v", tok.encode(PROMPTS[0]), greedy(20)))
    for _ in range(5):
        engine.step()
    sd = {k: v * 1.5 for k, v in model.state_dict().items()}
    engine.update_weights(sd, version=7)
    out = []
    while engine.has_work():
        out += engine.step()
    versions = out[0].versions
    assert versions[0] == 0 and versions[-1] == 7 and sorted(versions) == versions
    assert engine.stats().version == 7


def test_stats_count_tokens_and_record_occupancy(policy):
    model, tok = policy
    engine = LLMEngine(model, max_num_seqs=3, max_model_len=128)
    outs = engine.generate(requests(tok, greedy(10)))
    stats = engine.stats()
    assert stats.num_generated_tokens == sum(o.num_tokens for o in outs) == 10 * len(PROMPTS)
    assert stats.busy_s > 0 and max(n for _, n in stats.occupancy) == 3
    assert engine.stats().occupancy == []  # drained


@pytest.mark.parametrize("bad", [
    GenerateRequest("long", list(range(3, 3 + 10)) * 20, SamplingParams(max_new_tokens=4)),
    GenerateRequest("oov", [5, 10_000, 6], SamplingParams(max_new_tokens=4)),
    GenerateRequest("zero", [5, 6], SamplingParams(max_new_tokens=0)),
    GenerateRequest("neg", [5, 6], SamplingParams(max_new_tokens=-3)),
    GenerateRequest("empty", [], SamplingParams(max_new_tokens=3)),
])
def test_bad_request_fails_alone_and_engine_keeps_serving(policy, bad):
    model, tok = policy
    engine = AsyncEngine(LLMEngine(model, max_num_seqs=4, max_model_len=128))

    async def main():
        good = [engine.generate(r) for r in requests(tok, greedy(8))]
        return await asyncio.gather(engine.generate(bad), *good, return_exceptions=True)

    results = asyncio.run(main())
    assert isinstance(results[0], ValueError) and bad.request_id in str(results[0])
    assert all(o.num_tokens == 8 for o in results[1:])


def test_async_engine_serves_concurrent_calls_and_abort_all(policy):
    model, tok = policy
    engine = AsyncEngine(LLMEngine(model, max_num_seqs=4, max_model_len=256))

    async def main():
        tasks = [asyncio.ensure_future(engine.generate(r)) for r in requests(tok, greedy(200))]
        for _ in range(20):
            await asyncio.sleep(0)
        n = engine.abort_all()
        outs = await asyncio.gather(*tasks)
        assert engine.abort_all() == 0  # idempotent
        return n, outs

    n, outs = asyncio.run(main())
    assert n == len(PROMPTS)
    assert all(o.finish_reason == FinishReason.ABORT for o in outs)
    assert any(o.num_tokens > 0 for o in outs)


def _abort_after(engine, reqs, steps):
    for r in reqs:
        engine.add_request(r)
    for _ in range(steps):
        engine.step()
    return [engine.abort(r.request_id) for r in reqs]


@pytest.mark.parametrize("park_slots", [8, 3])
def test_resume_restores_parked_kv_and_matches_uninterrupted_greedy(policy, park_slots, reference):
    """With spare slots, an aborted sequence's cache is parked and a resume skips its prefill; with fewer
    spare slots than aborted sequences the oldest are evicted and re-prefilled. Either way the continuation
    is token for token the uninterrupted one."""
    model, tok = policy
    engine = LLMEngine(model, max_num_seqs=8, max_model_len=160, num_park_slots=park_slots)
    reqs = requests(tok, greedy(40))
    parts = _abort_after(engine, reqs, 7)
    assert engine.stats().num_parked == min(park_slots, len(reqs))
    prefill_before = engine.stats().num_prefill_tokens
    resumed = [GenerateRequest(f"{r.request_id}+", r.input_ids + p.token_ids, greedy(40 - len(p.token_ids)))
               for r, p in zip(reqs, parts)]
    rests = engine.generate(resumed)
    for p, r, part, rest in zip(PROMPTS, resumed, parts, rests):
        assert part.token_ids + rest.token_ids == reference(tok.encode(p), 40), p
    stats = engine.stats()
    hits = min(park_slots, len(reqs))  # the newest aborts stay parked
    assert stats.num_reused_tokens == sum(len(r.input_ids) - 1 for r in resumed[-hits:])
    assert stats.num_prefill_tokens - prefill_before == sum(len(r.input_ids) for r in resumed[:-hits])
    assert stats.num_parked == 0


def test_restored_kv_gives_the_logprobs_of_a_fresh_forward(policy):
    model, tok = policy
    engine = LLMEngine(model, max_num_seqs=8, max_model_len=128, seed=3, num_park_slots=8)
    sp = SamplingParams(temperature=1.0, max_new_tokens=30)
    reqs = requests(tok, sp)
    parts = _abort_after(engine, reqs, 5)
    resumed = [GenerateRequest(f"{r.request_id}+", r.input_ids + p.token_ids, SamplingParams(1.0, max_new_tokens=10))
               for r, p in zip(reqs, parts)]
    rests = engine.generate(resumed)
    assert engine.stats().num_reused_tokens > 0
    for r, out in zip(resumed, rests):
        full = torch.tensor([r.input_ids + out.token_ids])
        with torch.no_grad():
            logits = model(full).logits[0, len(r.input_ids) - 1: -1]
        ref = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("max_versions,bumps,reused", [(0, 0, True), (0, 1, False), (1, 1, True), (1, 2, False)])
def test_parked_kv_is_reused_only_within_the_staleness_bound(policy, max_versions, bumps, reused):
    model, tok = policy
    engine = LLMEngine(model, max_num_seqs=4, max_model_len=128, num_park_slots=4,
                       max_versions=max_versions)
    [req] = requests(tok, greedy(30), PROMPTS[:1])
    [part] = _abort_after(engine, [req], 4)
    for v in range(1, bumps + 1):
        engine.update_weights(None, version=v)
    [rest] = engine.generate([GenerateRequest("again", req.input_ids + part.token_ids, greedy(5))])
    assert (engine.stats().num_reused_tokens > 0) == reused
    assert rest.versions == [bumps] * 5
    # a different input never hits: the key is the exact token sequence
    [part2] = _abort_after(engine, [GenerateRequest("y", req.input_ids, greedy(30))], 4)
    before = engine.stats().num_reused_tokens
    engine.generate([GenerateRequest("other", req.input_ids + part2.token_ids[:-1], greedy(3))])
    assert engine.stats().num_reused_tokens == before


def test_sequences_parked_with_identical_tokens_all_restore_the_cache(policy, reference):
    """Samples of one prompt often begin with the same tokens, so several aborted sequences can carry
    exactly the same ids: every one of them restores the parked cache (one slot holds it for all), none
    re-prefills. Keyed by the ids alone, the second park used to replace the first one's entry and the
    first take removed it: a quarter of APRIL's resumes on the tiny task re-prefilled (N'/N = 1.5)."""
    model, tok = policy
    engine = LLMEngine(model, max_num_seqs=4, max_model_len=128, num_park_slots=4, max_versions=1)
    ids = tok.encode(PROMPTS[2])
    parts = _abort_after(engine, [GenerateRequest(f"t{i}", ids, greedy(30)) for i in range(3)], 5)
    assert len({tuple(p.token_ids) for p in parts}) == 1  # greedy: identical sequences
    assert engine.stats().num_parked == 3 and len(engine.parked.free) == 3
    engine.update_weights(None, version=1)  # one version stale: still reusable
    prefill = engine.stats().num_prefill_tokens
    rests = engine.generate([GenerateRequest(f"t{i}+", ids + p.token_ids, greedy(30 - len(p.token_ids)))
                             for i, p in enumerate(parts)])
    stats = engine.stats()
    assert stats.num_prefill_tokens == prefill
    assert stats.num_reused_tokens == 3 * (len(ids) + len(parts[0].token_ids) - 1)
    assert stats.num_parked == 0 and len(engine.parked.free) == 4
    for part, rest in zip(parts, rests):
        assert part.token_ids + rest.token_ids == reference(ids, 30)


def test_parked_kv_shares_identical_tokens_keeps_the_fresher_cache_and_evicts_by_recency():
    from april_ray.engine.scheduler import ParkedKV

    p = ParkedKV(first_slot=4, num_slots=2, max_versions=2)
    slot = p.park([1, 2, 3], version=3)
    assert p.park([1, 2, 3], version=2) is None  # an older cache of the same ids: the parked one serves both
    assert p.park([1, 2, 3], version=4) == slot  # a fresher one is copied over it, in place
    assert len(p) == 3 and len(p.free) == 1
    for _ in range(2):  # the slot stays taken until the last of them is restored
        assert p.take([1, 2, 3], version=6).slot == slot and len(p.free) == 1
    assert p.take([1, 2, 3], version=6).version == 4 and len(p.free) == 2
    assert p.take([1, 2, 3], version=6) is None and len(p) == 0
    a, b = p.park([1], 0), p.park([2], 0)
    assert p.park([1], 0) is None  # parked again: now the most recent
    c = p.park([3], 0)  # evicts [2], the oldest
    assert c == b and p.usable([1], 0) and not p.usable([2], 0) and len(p) == 3
    p.expire(3)
    assert len(p) == 0 and sorted(p.free) == sorted([a, b])


def test_kv_reuse_can_be_switched_off_and_on_at_run_time(policy):
    model, tok = policy
    engine = LLMEngine(model, max_num_seqs=4, max_model_len=128, num_park_slots=4, max_versions=3)
    [a, b] = requests(tok, greedy(30), PROMPTS[:2])
    [part_a] = _abort_after(engine, [a], 4)
    engine.set_kv_reuse(False)  # a's cache stays parked, but nothing is parked or restored now
    [part_b] = _abort_after(engine, [b], 4)
    assert engine.stats().num_parked == 1
    engine.generate([GenerateRequest("a1", a.input_ids + part_a.token_ids, greedy(5))])
    assert engine.stats().num_reused_tokens == 0
    engine.set_kv_reuse(True)
    [part_a2] = _abort_after(engine, [GenerateRequest("a2", a.input_ids, greedy(30))], 4)
    engine.generate([GenerateRequest("a3", a.input_ids + part_a2.token_ids, greedy(5))])
    assert engine.stats().num_reused_tokens == len(a.input_ids) + len(part_a2.token_ids) - 1


def test_repeated_interruptions_with_parking_and_eviction_stay_exact(policy, reference):
    """Four rounds of abort-all and resume (restored, or re-prefilled after an eviction) reproduce the
    uninterrupted greedy continuation of every request."""
    model, tok = policy
    engine = LLMEngine(model, max_num_seqs=8, max_model_len=160, num_park_slots=4)
    total = 36
    inputs = {f"r{i}": tok.encode(p) for i, p in enumerate(PROMPTS)}
    done = {rid: [] for rid in inputs}
    for rid, ids in inputs.items():
        engine.add_request(GenerateRequest(f"{rid}#0", ids, greedy(total)))
    for round_ in range(1, 5):
        for _ in range(4):
            for out in engine.step():
                done[out.request_id.split("#")[0]] += out.token_ids
        for out in engine.abort_all():
            done[out.request_id.split("#")[0]] += out.token_ids
        for rid, ids in inputs.items():
            left = total - len(done[rid])
            if left > 0:
                engine.add_request(GenerateRequest(f"{rid}#{round_}", ids + done[rid], greedy(left)))
    while engine.has_work():
        for out in engine.step():
            done[out.request_id.split("#")[0]] += out.token_ids
    for rid, p in zip(inputs, PROMPTS):
        assert done[rid] == reference(tok.encode(p), total), p
    stats = engine.stats()
    assert stats.num_reused_tokens > 0 and stats.num_prefill_tokens > sum(map(len, inputs.values()))


def test_decode_segments_cover_rows_in_order_with_room_for_each():
    from april_ray.engine.model_runner import decode_segments, fragmented, grouping_order, span_bucket

    rng = torch.Generator().manual_seed(0)
    for _ in range(200):
        pos = torch.randint(0, 600, (int(torch.randint(1, 65, (1,), generator=rng)),), generator=rng).tolist()
        segs = decode_segments(pos)
        assert [a for a, _, _ in segs] == [0] + [e for _, e, _ in segs[:-1]] and segs[-1][1] == len(pos)
        for a, e, span in segs:
            assert span == max(pos[a:e]) + 1
    # longest first: one range per span class, never fragmented
    pos = sorted([5, 70, 70, 130, 140, 300, 520, 9, 12, 40], reverse=True)
    segs = decode_segments(pos)
    assert len(segs) == len({span_bucket(p) for p in pos}) and not fragmented(pos, segs)
    # one short row inside a long range joins it; long rows scattered among short ones fragment
    assert decode_segments([300, 290, 10, 280]) == [(0, 4, 301)]
    scattered = [10, 12, 11, 300, 9, 8, 7, 400, 13, 14, 15]
    assert fragmented(scattered, decode_segments(scattered))
    # regrouping moves only the strays, and leaves one range per span class
    order = grouping_order(scattered)
    assert sorted(order) == list(range(len(scattered)))
    assert sum(o != i for i, o in enumerate(order)) == 4  # 300 and 400 swap with the two rows at the front
    regrouped = [scattered[i] for i in order]
    assert len(decode_segments(regrouped)) == 2 and not fragmented(regrouped, decode_segments(regrouped))
    for _ in range(100):
        pos = torch.randint(0, 600, (40,), generator=rng).tolist()
        regrouped = [pos[i] for i in grouping_order(pos)]
        assert sorted(regrouped) == sorted(pos)
        assert len(decode_segments(regrouped, straggler_rows=0)) == len({span_bucket(p) for p in pos})


def test_long_rows_scattered_among_short_ones_are_sorted_and_stay_exact(policy, reference):
    """Admission order puts two ~300-token inputs among short ones: the engine regroups the running batch
    (and its cache rows) by span class, and every continuation is still exactly HF's greedy one."""
    model, tok = policy
    short = ["0052-3:", "12-1:", "7-1:"]
    long_ = ["0321-1:" + " 0320" * 60, "0999-2:" + " 0997" * 70]
    prompts = short + long_[:1] + short + long_[1:] + short
    engine = LLMEngine(model, max_num_seqs=len(prompts), max_model_len=640)
    outs = engine.generate(requests(tok, greedy(20), prompts))
    assert engine.num_regroups >= 1
    for p, out in zip(prompts, outs):
        assert out.token_ids == reference(tok.encode(p), 20), p


def test_throughput_probe_counts_its_window_and_leaves_nothing_behind(policy):
    """The ceiling probe counts the tokens decoded in its window only (no draining tail of its own), ends
    with no request left in the engine, and does not touch the caches parked for real samples."""
    from april_ray.rollout.engine_worker import EngineWorker

    model, tok = policy
    core = LLMEngine(model, max_num_seqs=4, max_model_len=256, num_park_slots=4, max_versions=1)
    _abort_after(core, requests(tok, greedy(100), PROMPTS[:1]), 3)
    assert core.stats().num_parked == 1
    worker = EngineWorker(AsyncEngine(core), tok.decode, lambda *a: 0.0, SamplingParams(max_new_tokens=200))
    prompts = [tok.encode(p) for p in PROMPTS]
    before = core.stats().num_generated_tokens
    tokens, seconds, cpu = asyncio.run(worker.throughput_probe(prompts, 4, 0.3, warmup_s=0.1))
    stats = core.stats()
    assert 0 < tokens < stats.num_generated_tokens - before  # warm-up tokens and the aborted ones' last are not counted
    # process CPU time: every thread of the process (engine, event loop, torch's), at most all its cores
    assert 0.3 <= seconds < 30 and 0 < cpu < len(os.sched_getaffinity(0)) * seconds + 0.1
    assert not core.has_work() and stats.num_parked == 1


def test_bench_engine_task_mix_keeps_the_engine_saturated(policy):
    """The engine benchmark's task-mix figure: every slot refilled at once, counted after the warm-up."""
    from jobs.bench.engine import task_mix_tok_s

    model, tok = policy
    prompts = [tok.encode(p) for p in PROMPTS]
    sp = SamplingParams(temperature=1.0, max_new_tokens=40, stop_token_ids=(tok.eos_token_id,))
    tok_s, rows = task_mix_tok_s(model, prompts, sp, concurrency=8, max_model_len=160, seconds=0.3, warmup_s=0.1)
    assert tok_s > 0 and rows > 0.9 * 8  # a prompt finishing at its first token leaves a slot free for one step
