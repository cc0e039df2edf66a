"""Our engine server against clients it should refuse: no key or the wrong one, disk loads from elsewhere,
a pause or a session left open, and bodies that are wrong. Real server (a subprocess started by the
launcher), real HTTP requests, real bad bodies."""
import asyncio
import json
import shutil
import subprocess
import sys

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
                         extra_args=["--lease-s", "1", "--header-timeout-s", "2", "--body-timeout-s", "3"],
                         api_key="-api-key", admin_api_key="-admin-key")  # "-": not a flag
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


async def raw(srv, data: bytes, wait_s: float = 60.0) -> bytes:
    """What the server sends back on one connection to `data` (a request, or part of one), until it closes
    the connection; b"TIMEOUT" if it keeps it open for `wait_s` (far past any timeout of the server)."""
    host, port = srv.url.rsplit("/", 1)[-1].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    try:
        return await asyncio.wait_for(reader.read(), wait_s)
    except ConnectionResetError:
        return b""
    except asyncio.TimeoutError:
        return b"TIMEOUT"
    finally:
        writer.close()


async def still_open_after(srv, auth: bytes, idle_s: float) -> bool:
    """Whether a connection that made one GET /health (sending `auth` headers) serves another after `idle_s`."""
    host, port = srv.url.rsplit("/", 1)[-1].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n"
    try:
        writer.write(health)
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")  # (no body)
        await asyncio.sleep(idle_s)
        writer.write(health)
        return (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)).startswith(b"HTTP/1.1 200")
    except (asyncio.IncompleteReadError, ConnectionError):
        return False
    finally:
        writer.close()


def test_slow_and_odd_clients_get_an_answer_or_are_dropped(server):
    """A half-sent request line is dropped after the header timeout (2 s here), and so is a connection idle
    after a request without a key (one with a key is kept, as aiohttp's client pool expects); a body that stops coming
    gets a 408 after the body timeout (3 s), a body declared over the limit a 413 at once, an Authorization
    header that is not UTF-8 a 401; /metrics is open and is Prometheus text of the engine's counters."""
    key = f"Bearer {server.api_key}".encode()

    def post_head(length: int, auth: bytes = key) -> bytes:
        return (b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Authorization: " + auth + b"\r\nContent-Length: " + str(length).encode() + b"\r\n\r\n")

    async def main():
        gen = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 3}}
        assert (await post(server, "/generate", gen, "api"))[0] == 200
        answers = await asyncio.gather(
            raw(server, b"GET /heal"),
            raw(server, post_head(1_000_000) + b'{"input_ids": [3, '),
            raw(server, post_head(50 << 20)),
            raw(server, post_head(2, b"Bearer \xff\xfe\x80" + key[7:]) + b"{}"),
            still_open_after(server, b"", 6), still_open_after(server, b"Authorization: " + key + b"\r\n", 6))
        return answers, await post(server, "/metrics", method="GET")
    (half_line, slow_body, huge, bad_bytes, unkeyed_kept, keyed_kept), (status, metrics) = asyncio.run(main())
    assert keyed_kept and not unkeyed_kept
    assert half_line == b"", half_line[:200]
    assert slow_body.startswith(b"HTTP/1.1 408") and b"--body-timeout-s" in slow_body, slow_body[:300]
    assert huge.startswith(b"HTTP/1.1 413") and b"--max-body-mb" in huge, huge[:300]
    assert bad_bytes.startswith(b"HTTP/1.1 401") and b"Unauthorized" in bad_bytes, bad_bytes[:300]
    assert status == 200 and "# TYPE april_engine_generated_tokens_total counter" in metrics
    samples = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if not line.startswith("#"))
    assert float(samples["april_engine_generated_tokens_total"]) >= 3
    assert float(samples['april_engine_connections_closed_total{reason="header_timeout"}']) >= 1
    assert float(samples['april_engine_connections_closed_total{reason="body_timeout"}']) >= 1


def test_a_weights_file_linked_from_outside_the_roots_is_refused(server, random_model_dir, tmp_path):
    """Inside the weights root, a directory whose model.safetensors is a link to a file elsewhere: refused,
    naming the file; the same file copied in loads."""
    outside = tmp_path / "outside"
    shutil.copytree(random_model_dir, outside)
    inside = server.root / "linked"
    inside.mkdir()
    (inside / "model.safetensors").symlink_to(outside / "model.safetensors")

    async def main():
        linked = await post(server, "/update_weights_from_disk", {"model_path": str(inside)}, "admin")
        (inside / "model.safetensors").unlink()
        shutil.copy(outside / "model.safetensors", inside / "model.safetensors")
        copied = await post(server, "/update_weights_from_disk", {"model_path": str(inside)}, "admin")
        return linked, copied
    (status, text), copied = asyncio.run(main())
    assert status == 400 and "model.safetensors" in text and "outside" in text, text
    assert copied[0] == 200, copied


def test_a_keyless_server_refuses_a_public_address_unless_told(random_model_dir):
    """One line on stderr, before the model is loaded; loopback, a key, or the flag let it start."""
    from april_ray.engine.http_wire import refuse_keyless_public

    proc = subprocess.run([sys.executable, "-m", "april_ray.engine.http_server", "--model-path", str(random_model_dir),
                           "--host", "0.0.0.0", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--allow-keyless-public" in proc.stderr and "--api-key" in proc.stderr and "0.0.0.0" in proc.stderr
    for host, key, allow in (("127.0.0.1", "", False), ("localhost", "", False), ("::1", "", False),
                             ("0.0.0.0", "k", False), ("0.0.0.0", "", True)):
        refuse_keyless_public(host, key, allow)
    with pytest.raises(SystemExit, match="not a loopback"):
        refuse_keyless_public("::", "", False)
