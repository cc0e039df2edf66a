"""The SGLang client (`engine/sglang_client.py`) against our engine's HTTP server (`engine/http_server.py`),
started as a real subprocess by the launcher (`engine/sglang_server.py`) on a free 127.0.0.1 port: the
same client, abort and pause semantics and weight-sync code a GPU cluster runs against SGLang."""
import asyncio
import base64
import os
import pickle

import pytest
import torch

from april_ray.weights.broadcast import BroadcastGroup
from april_ray.weights.disk import save_for_disk_update
from april_ray.engine.base import BadRequestError
from april_ray.engine.sglang_client import SGLangEngine
from april_ray.engine.sglang_server import CPUServerLauncher, ServerDied, ServerOptions
from april_ray.engine.weight_handoff import send_tensors, weight_update
from april_ray.types import FinishReason, GenerateRequest, SamplingParams

PROMPTS = ["0052-3:", "12-1:", "0999-2: 0997", "7-1:", "hello world", "0153-3: 0150 0147 0144"]
MAX_LEN = 640


def greedy(n):
    return SamplingParams(temperature=0.0, max_new_tokens=n)


def hf_greedy(model, ids, n):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


def start(model_dir, tmp_path_factory, **kw):
    opts = ServerOptions(str(model_dir), max_num_seqs=8, max_model_len=MAX_LEN, park_slots=8,
                         startup_timeout_s=120, log_dir=str(tmp_path_factory.mktemp("logs")), **kw)
    return CPUServerLauncher().start(opts)


@pytest.fixture(scope="module")
def model(random_model_dir):
    from april_ray.model import load_policy

    return load_policy(random_model_dir)


@pytest.fixture(scope="module")
def server(random_model_dir, tmp_path_factory):
    srv = start(random_model_dir, tmp_path_factory)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def weights_server(random_model_dir, tmp_path_factory):
    """A server of its own for the tests that change its weights (from disk: under the tests' tmp_path)."""
    srv = start(random_model_dir, tmp_path_factory, weights_root=str(tmp_path_factory.getbasetemp()))
    yield srv
    srv.stop()


def run(coro_fn, srv, **kw):
    """Run `coro_fn(client)` with a fresh client of `srv` on a fresh event loop."""
    async def main():
        client = SGLangEngine(srv.url, max_model_len=MAX_LEN, server=srv, **kw)
        try:
            return await coro_fn(client)
        finally:
            await client.close()
    return asyncio.run(main())


async def progress(client, at_least=1, running=1):
    """Wait until `running` requests are in the server's batch and it has generated `at_least` tokens since
    (so an abort lands mid-generation of each of them)."""
    start_tokens = None
    for _ in range(6000):
        info = await client.request("GET", "/get_server_info")
        if start_tokens is None and info["num_running"] >= running:
            start_tokens = info["num_generated_tokens"]
        if start_tokens is not None and info["num_generated_tokens"] - start_tokens >= at_least:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"the server did not run {running} requests and generate {at_least} tokens: {info}")


def test_greedy_tokens_and_logprobs_match_the_model(server, model):
    model, tok = model
    reqs = [GenerateRequest(f"g{i}", tok.encode(p), greedy(24)) for i, p in enumerate(PROMPTS)]
    sampled = [GenerateRequest(f"s{i}", tok.encode(p), SamplingParams(0.7, max_new_tokens=20))
               for i, p in enumerate(PROMPTS)]

    async def main(c):
        return await asyncio.gather(*[c.generate(r) for r in reqs + sampled]), c.stats()

    outs, stats = run(main, server)
    for r, out in zip(reqs, outs):
        assert out.token_ids == hf_greedy(model, r.input_ids, 24)
        assert out.finish_reason == FinishReason.LENGTH and out.versions == [0] * 24
    for r, out in zip(sampled, outs[len(reqs):]):
        with torch.no_grad():
            logits = model(torch.tensor([r.input_ids + out.token_ids])).logits[0, len(r.input_ids) - 1: -1] / 0.7
        ref = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-4, rtol=1e-4)
    assert stats.num_generated_tokens == 24 * len(reqs) + 20 * len(sampled) and stats.num_running == 0


def test_stop_token_ends_with_it(server, model):
    model, tok = model
    ids = tok.encode(PROMPTS[0])
    first = hf_greedy(model, ids, 3)
    req = GenerateRequest("stop", ids, SamplingParams(0.0, max_new_tokens=20, stop_token_ids=(first[2],)))
    out = run(lambda c: c.generate(req), server)
    assert out.finish_reason == FinishReason.STOP and out.token_ids[-1] == first[2] and len(out.token_ids) <= 3


def test_abort_one_and_all_return_exact_prefixes_and_resume_continues(server, model):
    model, tok = model
    budget = 500
    reqs = [GenerateRequest(f"a{i}", tok.encode(p), greedy(budget)) for i, p in enumerate(PROMPTS[:4])]

    async def main(c):
        tasks = [asyncio.ensure_future(c.generate(r)) for r in reqs]
        await progress(c, 8, running=len(reqs))  # two steps of all four: each has tokens
        assert c.abort("a0")
        first = await tasks[0]
        assert c.abort_all() == 3
        rest = await asyncio.gather(*tasks[1:])
        assert c.abort_all() == 0 and not c.abort("a0")
        parts = [first, *rest]
        resumed = await asyncio.gather(*[
            c.generate(GenerateRequest(f"{r.request_id}+", r.input_ids + p.token_ids, greedy(budget - p.num_tokens)))
            for r, p in zip(reqs, parts)])
        return parts, resumed, c.stats()

    parts, resumed, stats = run(main, server)
    for r, part, rest in zip(reqs, parts, resumed):
        full = hf_greedy(model, r.input_ids, budget)
        assert part.finish_reason == FinishReason.ABORT and 0 < part.num_tokens < budget
        assert part.token_ids == full[: part.num_tokens]
        assert len(part.logprobs) == len(part.versions) == part.num_tokens
        assert part.token_ids + rest.token_ids == full and rest.finish_reason == FinishReason.LENGTH
    # the server parked the aborted caches: the resumes were served from them, and said so
    assert stats.num_reused_tokens == sum(len(r.input_ids) + p.num_tokens - 1 for r, p in zip(reqs, parts))


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_modes(server, model, mode):
    """abort: running calls return their partial output; retract and in_place: they stay, and finish after
    continue exactly as if never paused. In every mode a call made while paused waits for continue."""
    model, tok = model
    budget = 300
    req = GenerateRequest("p0", tok.encode(PROMPTS[2]), greedy(budget))
    late = GenerateRequest("p1", tok.encode(PROMPTS[3]), greedy(10))

    async def main(c):
        task = asyncio.ensure_future(c.generate(req))
        await progress(c, 4)
        await c.pause_generation(mode)
        paused_at = (await c.request("GET", "/get_server_info"))["num_generated_tokens"]
        waiting = asyncio.ensure_future(c.generate(late))
        await asyncio.sleep(0.3)
        info = await c.request("GET", "/get_server_info")
        assert not waiting.done() and info["paused"]
        if mode != "abort":
            assert not task.done() and info["num_generated_tokens"] == paused_at  # nothing runs while paused
        await c.continue_generation()
        return await task, await waiting

    out, late_out = run(main, server)
    full = hf_greedy(model, req.input_ids, budget)
    if mode == "abort":
        assert out.finish_reason == FinishReason.ABORT and 0 < out.num_tokens < budget
        assert out.token_ids == full[: out.num_tokens]
    else:
        assert out.finish_reason == FinishReason.LENGTH and out.token_ids == full
    assert late_out.token_ids == hf_greedy(model, late.input_ids, 10)


def test_flush_cache_refused_while_requests_run(server, model):
    model, tok = model

    async def main(c):
        task = asyncio.ensure_future(c.generate(GenerateRequest("f", tok.encode(PROMPTS[0]), greedy(400))))
        await progress(c)
        refused = await c.flush_cache()
        release = None
        try:
            await c.release_memory_occupation()
        except BadRequestError as e:
            release = str(e)
        c.abort("f")
        await task
        return refused, release, await c.flush_cache()

    refused, release, flushed = run(main, server)
    assert refused is False and flushed is True
    assert "idle" in release and "/release_memory_occupation" in release


def test_bad_request_fails_alone_with_400(server, model):
    model, tok = model
    bad = GenerateRequest("long", [5] * (MAX_LEN + 5), greedy(4))
    good = [GenerateRequest(f"ok{i}", tok.encode(p), greedy(8)) for i, p in enumerate(PROMPTS)]

    async def main(c):
        results = await asyncio.gather(c.generate(bad), *[c.generate(r) for r in good], return_exceptions=True)
        raw = await c._http().post(f"{c.url}/generate", json={"input_ids": [1, 2], "sampling_params": {"regex": "a"}},
                                   headers={"Authorization": f"Bearer {server.api_key}"})
        return results, raw.status, await raw.json()

    results, status, body = run(main, server)
    assert isinstance(results[0], BadRequestError) and isinstance(results[0], ValueError)
    assert "400" in str(results[0]) and "max_model_len" in str(results[0]) and server.url in str(results[0])
    assert all(o.num_tokens == 8 for o in results[1:])
    assert status == 400 and "regex" in body["error"]["message"]


def perturbed(model, seed):
    """A learner's state dict after some training: every parameter moved (tied ones stay one tensor)."""
    g = torch.Generator().manual_seed(seed)
    clone = type(model)(model.config).eval()
    clone.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in clone.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return clone.state_dict()


def expected(model, sd, prompts, n):
    clone = type(model)(model.config).eval()
    clone.load_state_dict(sd)
    return [hf_greedy(clone, ids, n) for ids in prompts]


async def greedy_outputs(c, prompts, n):
    return await asyncio.gather(*[c.generate(GenerateRequest(f"w{i}", ids, greedy(n))) for i, ids in enumerate(prompts)])


@pytest.mark.parametrize("how", ["broadcast", "tensor", "disk"])
def test_weight_update_changes_outputs_to_the_new_weights(weights_server, model, how, tmp_path):
    """After an update the server's greedy outputs are the new weights' own `model.generate` ones, and its
    tokens carry the new version. Broadcast: a gloo group of its own (no default group in this process),
    several buckets. Tensor: shared-memory handles. Disk: a safetensors directory."""
    model, tok = model
    prompts = [tok.encode(p) for p in PROMPTS[:4]]
    version = {"broadcast": 11, "tensor": 12, "disk": 13}[how]
    sd = perturbed(model, version)
    named = list(sd.items())

    async def main(c):
        before = await greedy_outputs(c, prompts, 16)
        if how == "broadcast":
            sender = BroadcastGroup("127.0.0.1", "gloo", bucket_mb=0.1, timeout_s=60)
            assert await sender.send([c], named, version, flush_cache=True) == [c.url]
            await sender.close()
        elif how == "tensor":
            await send_tensors(c, named, version, flush_cache=True, bucket_mb=0.1)
        else:
            save_for_disk_update(named, str(tmp_path / "w"), str(model.name_or_path))
            await c.update_weights_from_disk(str(tmp_path / "w"), flush_cache=True, weight_version=version)
        c.update_weights(None, version)
        return before, await greedy_outputs(c, prompts, 16), await c.model_info()

    had_default_group = torch.distributed.is_initialized()  # (an in-process DeepSpeed test may have made one)
    before, after, info = run(main, weights_server)
    assert [o.token_ids for o in after] == expected(model, sd, prompts, 16)
    assert [o.token_ids for o in before] != [o.token_ids for o in after]
    assert all(o.versions == [version] * 16 for o in after) and info["weight_version"] == str(version)
    assert torch.distributed.is_initialized() == had_default_group  # the broadcast's group is its own


@pytest.mark.parametrize("how", ["broadcast", "tensor", "disk"])
def test_non_finite_weights_are_refused_by_name_and_the_served_ones_stay(weights_server, model, how, tmp_path):
    """New weights with a NaN in one tensor and an infinity in another, by each path: refused, naming the
    tensor, and the server's greedy outputs are those of the weights it had. One bucket: the refusal is of
    the bucket that holds the bad tensor."""
    model, tok = model
    prompts = [tok.encode(p) for p in PROMPTS[:3]]
    sd = perturbed(model, 31)
    sd["model.norm.weight"][3] = float("nan")
    sd["model.layers.1.mlp.up_proj.weight"][0, 0] = float("inf")
    named = list(sd.items())

    async def main(c):
        before = await greedy_outputs(c, prompts, 12)
        sender = BroadcastGroup("127.0.0.1", "gloo", bucket_mb=1024, timeout_s=60)
        with pytest.raises(BadRequestError, match="NaN or infinite") as refused:
            if how == "broadcast":
                await sender.send([c], named, 41, flush_cache=True)  # a refusal is raised, not retried
            elif how == "tensor":
                await send_tensors(c, named, 41, flush_cache=True, bucket_mb=1024)
            else:
                save_for_disk_update(named, str(tmp_path / "w"), str(model.name_or_path))
                await c.update_weights_from_disk(str(tmp_path / "w"), flush_cache=True, weight_version=41)
        await sender.close()
        assert "model.norm.weight" in str(refused.value) and "up_proj.weight" in str(refused.value)
        return before, await greedy_outputs(c, prompts, 12), await c.model_info()

    before, after, info = run(main, weights_server)
    assert [o.token_ids for o in after] == [o.token_ids for o in before]
    assert info["weight_version"] != "41"


def test_memory_release_and_resume_cycle(weights_server, model):
    """Colocated: the engine gives its KV cache and weights back while the learner trains, refuses to
    generate meanwhile, and serves the weights handed to it after resuming."""
    model, tok = model
    prompts = [tok.encode(p) for p in PROMPTS[:3]]
    sd = perturbed(model, 21)

    async def main(c):
        await c.release_memory_occupation(["weights", "kv_cache"])
        info = await c.request("GET", "/get_server_info")
        with pytest.raises(BadRequestError, match="released"):
            await c.generate(GenerateRequest("x", prompts[0], greedy(4)))
        await c.resume_memory_occupation(["weights"])
        await send_tensors(c, list(sd.items()), 21, flush_cache=True, bucket_mb=1)
        await c.resume_memory_occupation(["kv_cache"])
        return info, await greedy_outputs(c, prompts, 12)

    info, outs = run(main, weights_server)
    assert info["released"] == ["kv_cache", "weights"]
    assert [o.token_ids for o in outs] == expected(model, sd, prompts, 12)


def test_tensor_payload_with_anything_but_tensors_is_refused(weights_server):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    payload = base64.b64encode(pickle.dumps([("model.norm.weight", Evil())])).decode()

    async def main(c):
        with pytest.raises(BadRequestError, match="must run between begin_weight_update"):  # as SGLang
            await c.update_weights_from_tensor([payload], flush_cache=False)
        await c.begin_weight_update()
        with pytest.raises(BadRequestError, match="already open"):
            await c.begin_weight_update()
        with pytest.raises(BadRequestError, match="not allowed"):
            await c.update_weights_from_tensor([payload], flush_cache=False)
        await c.end_weight_update()
        with pytest.raises(BadRequestError, match="not a parameter"):
            await send_tensors(c, [("nope", torch.zeros(2))], 99, flush_cache=False, bucket_mb=1)
        # the refused update closed its session and let generation go on: the server is not left paused
        await c.begin_weight_update()
        await c.end_weight_update()
        out = await asyncio.wait_for(c.generate(GenerateRequest("after", [3, 4, 5], greedy(2))), 30)
        assert len(out.token_ids) == 2
    run(main, weights_server)


def test_a_server_that_dies_is_reported_with_its_log_tail(random_model_dir, tmp_path_factory, model):
    with pytest.raises(ServerDied, match="exited with code") as e:
        start(tmp_path_factory.mktemp("empty-model"), tmp_path_factory)
    assert "last lines" in str(e.value) and "Error" in str(e.value)
    srv = start(random_model_dir, tmp_path_factory)
    srv.proc.kill()
    srv.proc.wait()

    async def main(c):
        with pytest.raises(ServerDied, match="exited with code") as died:
            await c.generate(GenerateRequest("d", [5, 6, 7], greedy(4)))
        return str(died.value)
    msg = run(main, srv)
    assert srv.url in msg and "april-ray engine server on" in msg  # the log tail: the line it printed at start


def test_stop_rule_is_sglangs_the_request_s_ids_and_the_models_eos_unless_ignore_eos():
    """SGLang stops at the request's stop ids and the model's EOS ids, and `ignore_eos` turns off both
    (its `_check_token_based_finish` returns before either): the client sends it only for a request
    without stop ids, which runs to its budget as in our engine."""
    from april_ray.engine.http_wire import parse_sampling

    assert parse_sampling({"stop_token_ids": [7]}, (2,)).stop_token_ids == (7, 2)
    assert parse_sampling({"stop_token_ids": [7], "ignore_eos": True}, (2,)).stop_token_ids == ()
    assert parse_sampling({}, (2,)).stop_token_ids == (2,)


def test_a_weight_update_that_fails_on_one_server_leaves_none_paused_or_in_a_session():
    """`engine.weight_handoff.weight_update` over servers where a pause, or a begin, fails on one: every server that
    began a session ends it, every server continues, and the error goes on up."""
    class Server:
        def __init__(self, fail=None):
            self.fail, self.calls = fail, []

        async def _call(self, name):
            self.calls.append(name)
            if name == self.fail:
                raise RuntimeError(f"{name} refused")

        async def pause_generation(self, mode):
            await self._call("pause")

        async def begin_weight_update(self):
            await self._call("begin")

        async def end_weight_update(self):
            await self._call("end")

        async def continue_generation(self):
            await self._call("continue")

    async def update(servers, body_fails=False):
        async with weight_update(servers):
            if body_fails:
                raise ValueError("bucket refused")

    for fail, expect in (("pause", ["pause", "continue"]), ("begin", ["pause", "begin", "continue"])):
        servers = [Server(), Server(fail)]
        with pytest.raises(RuntimeError, match=f"{fail} refused"):
            asyncio.run(update(servers))
        assert servers[0].calls == (["pause", "continue"] if fail == "pause" else ["pause", "begin", "end", "continue"])
        assert servers[1].calls == expect
    servers = [Server(), Server()]
    with pytest.raises(ValueError, match="bucket refused"):
        asyncio.run(update(servers, body_fails=True))
    assert all(s.calls == ["pause", "begin", "end", "continue"] for s in servers)
    asyncio.run(update(servers))
    assert all(s.calls[4:] == ["pause", "begin", "end", "continue"] for s in servers)
