"""Our engine server against clients it should refuse: no key or the wrong one, disk loads from elsewhere,
a pause or a session left open, and bodies that are wrong. Real server (a subprocess started by the
launcher), real HTTP requests, real bad bodies."""
import asyncio
import json
import shutil

import aiohttp
import pytest

from april_ray.engine.sglang_client import SGLangEngine
from april_ray.engine.sglang_server import CPUServerLauncher, ServerOptions
from april_ray.types import GenerateRequest, SamplingParams

MAX_LEN = 640


@pytest.fixture(scope="module")
def server(random_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("weights-root")
    opts = ServerOptions(str(random_model_dir), max_num_seqs=8, max_model_len=MAX_LEN, startup_timeout_s=120,
                         log_dir=str(tmp_path_factory.mktemp("logs")), weights_root=str(root),
                         extra_args=["--lease-s", "1"], api_key="-api-key", admin_api_key="-admin-key")  # "-": not a flag
    srv = CPUServerLauncher().start(opts)
    srv.root = root
    yield srv
    srv.stop()


async def post(srv, path, body=None, key=None, data=None, method="POST"):
    """(status, text) of one raw request; `key`: 'api', 'admin', None or a literal string."""
    key = {"api": srv.api_key, "admin": srv.admin_api_key}.get(key, key)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s:
        async with s.request(method, srv.url + path, json=body, data=data, headers=headers) as r:
            return r.status, await r.text()


def test_engine_endpoints_need_the_right_key_as_in_sglang(server, random_model_dir, tmp_path):
    """SGLang 0.5.23 with --api-key and --admin-api-key: generation takes the API key, the admin endpoints
    only the admin key, health is open; disk loads only from the model's directory or the root; a stray
    pause or session ends with its lease, so generation and the next update go on."""
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(random_model_dir, elsewhere)
    gen = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}

    async def main():
        assert (await post(server, "/health", method="GET"))[0] == 200
        for key in (None, "admin", "wrong"):
            assert (await post(server, "/generate", gen, key))[0] == 401
        assert (await post(server, "/generate", gen, "api"))[0] == 200
        admin = {"/update_weights_from_disk": {"model_path": str(random_model_dir)},
                 "/pause_generation": {"mode": "in_place"}, "/begin_weight_update": {},
                 "/init_weights_update_group": {"master_address": "10.0.0.1", "master_port": 1, "rank_offset": 1,
                                                "world_size": 2},
                 "/release_memory_occupation": {}, "/abort_request": {"abort_all": True}, "/flush_cache": {}}
        for path, body in admin.items():
            for key in (None, "api"):
                status, text = await post(server, path, body, key)
                assert status == 401 and "Unauthorized" in text, (path, key)
        # disk: the model's own directory yes, anywhere else no
        assert (await post(server, "/update_weights_from_disk", {"model_path": str(random_model_dir)}, "admin"))[0] == 200
        status, text = await post(server, "/update_weights_from_disk", {"model_path": str(elsewhere)}, "admin")
        assert status == 400 and "outside" in text and "model_path" in text
        # a pause never continued, and a session never ended, end with their lease (1 s here)
        assert (await post(server, "/begin_weight_update", {}, "admin"))[0] == 200
        assert (await post(server, "/pause_generation", {"mode": "in_place"}, "admin"))[0] == 200
        client = SGLangEngine(server.url, max_model_len=MAX_LEN, server=server)

        async def engine_aborts():  # the engine's own admin calls do not keep a stray pause alive
            while True:
                await client.request("POST", "/abort_request", {"rid": "not-running"})
                await asyncio.sleep(0.2)
        aborts = asyncio.ensure_future(engine_aborts())
        out = await asyncio.wait_for(client.generate(GenerateRequest("g", [3, 4, 5], SamplingParams(0.0, max_new_tokens=2))), 60)
        aborts.cancel()
        assert len(out.token_ids) == 2
        await client.begin_weight_update()  # the learner's next update is not refused as "already open"
        await client.end_weight_update()
        await client.close()
    asyncio.run(main())


def test_a_bad_request_fails_alone_with_400_naming_the_field(server):
    """A temperature that overflows float32, among 30 good requests: every good one is answered. Each bad
    body is a 400 naming what is wrong; a body over the limit is refused before it is read whole."""
    (server.root / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")

    def gen(**sp):
        return {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 4, **sp}}

    bad = [("/generate", gen(temperature=1e-40, top_k=-1), 200),  # greedy below 1e-6, as in SGLang
           ("/generate", {"input_ids": [3], "sampling_params": "greedy"}, "sampling_params"),
           ("/generate", {"input_ids": [3], "sampling_params": [1]}, "sampling_params"),
           ("/generate", '{"input_ids": [3], "sampling_params": {"max_new_tokens": 1e400}}', "max_new_tokens"),
           ("/generate", '{"input_ids": [3], "sampling_params": {"temperature": NaN}}', "temperature"),
           ("/generate", gen(top_p=0), "top_p"), ("/generate", gen(top_k=0), "top_k"),
           ("/generate", gen(stop_token_ids="2"), "stop_token_ids"), ("/generate", gen(ignore_eos="yes"), "ignore_eos"),
           ("/generate", {"input_ids": [3], "rid": ["a", "b"]}, "rid"),
           ("/abort_request", {"rid": ["a"]}, "rid"), ("/abort_request", [1], "JSON object"),
           ("/pause_generation", [], "JSON object"), ("/resume_memory_occupation", {"tags": "weights"}, "tags"),
           ("/update_weights_from_disk", {"model_path": str(server.root)}, "model.safetensors"),
           ("/update_weights_from_disk", {"model_path": 5}, "model_path"),
           ("/update_weights_from_distributed", [], "JSON object")]

    async def main():
        good = [post(server, "/generate", gen(temperature=1.0), "api") for _ in range(30)]
        results = await asyncio.gather(*good, *[
            post(server, path, None if isinstance(body, str) else body, "api" if path == "/generate" else "admin",
                 data=body if isinstance(body, str) else None) for path, body, _ in bad])
        big = await post(server, "/generate", None, "api", data=json.dumps({"input_ids": [1] * 3_000_000}))
        return results, big
    results, big = asyncio.run(main())
    assert all(status == 200 for status, _ in results[:30])
    for (path, body, expect), (status, text) in zip(bad, results[30:]):
        if expect == 200:
            assert status == 200, (path, text)
        else:
            assert status == 400 and expect in text, (path, body, status, text)
    assert big[0] == 413


def test_a_request_whose_sampling_fails_fails_alone_in_the_engine(random_model_dir):
    """Behind the door's checks (the in-actor engine has none): a temperature whose logits overflow fails its
    own call with ValueError; the calls sampled in the same batch finish."""
    from april_ray.engine.async_engine import AsyncEngine
    from april_ray.engine.cpu_engine import LLMEngine
    from april_ray.model import load_policy

    model, _ = load_policy(random_model_dir)
    engine = AsyncEngine(LLMEngine(model, max_num_seqs=8, max_model_len=MAX_LEN))

    async def main():
        good = [engine.generate(GenerateRequest(f"ok{i}", [3, 4, 5 + i], SamplingParams(1.0, max_new_tokens=6)))
                for i in range(6)]
        bad = engine.generate(GenerateRequest("bad", [3, 4, 5], SamplingParams(1e-40, max_new_tokens=6)))
        return await asyncio.gather(bad, *good, return_exceptions=True)
    results = asyncio.run(main())
    assert isinstance(results[0], ValueError) and "bad" in str(results[0]) and "temperature" in str(results[0])
    assert all(len(r.token_ids) == 6 for r in results[1:])
