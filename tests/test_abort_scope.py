"""A step's interrupt aborts its own requests and nothing else on the engine: in the overlapped mode an
evaluation shares the engines with the next step's rollout, and an interrupt that aborted every request
cut the evaluation's responses short (held-out accuracy read 0.000; issue 54).

Each test makes the interrupt and the evaluation meet on purpose: it waits until the evaluation's requests
and the step's are running on the engine, then interrupts the step. On the fake engine, the in-actor CPU
engine and our CPU server behind SGLang's HTTP API (engine.backend=cpu_http)."""
import asyncio

import pytest

from april_ray.rollout.engine_worker import EngineWorker, step_tag
from april_ray.rollout.episode import ToolJournal
from april_ray.types import FinishReason, GenerateRequest, Sample, SampleState, SamplingParams
from tests.fakes import FakeEngine, parity_reward

STEP, OTHER = ("run", 1), ("run", 11)  # the other step's name ends with this one's number
WHOLE = (FinishReason.STOP, FinishReason.LENGTH)


class Recording:
    """The engine, with every output kept by request id."""

    def __init__(self, engine):
        self.engine, self.outputs = engine, {}

    async def generate(self, request):
        out = await self.engine.generate(request)
        self.outputs[request.request_id] = out
        return out

    def __getattr__(self, name):
        return getattr(self.engine, name)


async def until(condition, what: str, over=lambda: False, timeout_s: float = 300.0):
    """Poll `condition()` until it holds; fail once `over()` says it never will (the timeout bounds a broken
    test, it is not a timing assumption)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert not over() and loop.time() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.002)


def group(gid: str, n: int, length: int, budget: int) -> list[Sample]:
    """`n` samples that stop at `length` tokens on the fake engine."""
    return [Sample(f"{gid}s{i}", gid, "p", "", [length], budget) for i in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n)


# -- the fake engine: the worker's side of the protocol ---------------------------------------------------

def fake_worker() -> tuple[FakeEngine, EngineWorker]:
    engine = FakeEngine(tick=0.0005)
    sp = SamplingParams(temperature=1.0, max_new_tokens=400)
    return engine, EngineWorker(engine, lambda ids: "x" * len(ids), parity_reward, sp)


def test_a_steps_interrupt_aborts_its_requests_and_neither_another_steps_nor_an_evaluations():
    engine, worker = fake_worker()
    items = [(f"q{i}", [300], "True", {}) for i in range(4)]

    async def main():
        mine = asyncio.ensure_future(worker.generate_group(group("a", 4, 300, 400), STEP))
        other = asyncio.ensure_future(worker.generate_group(group("b", 4, 300, 400), OTHER))
        evaluation = asyncio.ensure_future(worker.evaluate(items, 1.0, "eval"))
        await until(lambda: len(engine.running) == 12 and all(t for _, t, _ in engine.running.values()),
                    "the twelve requests running")
        aborted = worker.abort_all(STEP)
        assert worker.abort_all(STEP) == 0  # idempotent: nothing of the step is left
        return aborted, await mine, await other, await evaluation

    aborted, (_, mine), (_, other), results = asyncio.run(main())
    assert aborted == 4
    assert all(s.state == SampleState.PARTIAL and 0 < len(s.response_ids) < 300 for s in mine)
    assert all(s.state == SampleState.FINISHED and len(s.response_ids) == 300 for s in other)
    assert results == [(1.0, 300)] * 4  # whole responses, scored
    assert all(rid.endswith(step_tag(STEP)) or rid.endswith(step_tag(OTHER)) or rid.startswith("eval-")
               for rid in engine.request_ids)


def test_an_evaluation_episode_runs_on_through_a_steps_interrupt():
    engine, worker = fake_worker()

    async def one_turn(ep):
        await ep.generate()

    worker.use_episodes(one_turn, ToolJournal(), max_model_len=1024, tool_timeout_s=5.0, encode=lambda t: [1])

    async def main():
        mine = asyncio.ensure_future(worker.generate_group(group("a", 2, 300, 400), STEP))
        evaluation = asyncio.ensure_future(worker.evaluate([("q", [300], "True", {})], 1.0, "eval"))
        await until(lambda: len(engine.running) == 3 and all(t for _, t, _ in engine.running.values()),
                    "the episodes' requests running")
        worker.abort_all(STEP)
        return await mine, await evaluation

    (_, mine), results = asyncio.run(main())
    assert all(s.state == SampleState.PARTIAL and s.finish_reason == FinishReason.ABORT for s in mine)
    assert results == [(1.0, 300)]


# -- the engines' side: `abort_tagged` ------------------------------------------------------------------

def test_the_cpu_engine_aborts_the_tagged_requests_parks_their_caches_and_runs_the_rest_whole(policy):
    from april_ray.engine.cpu_engine import LLMEngine

    model, tok = policy
    ids = tok.encode("0052-3:")
    engine = LLMEngine(model, max_num_seqs=3, max_model_len=128, num_park_slots=4)
    tag = step_tag(STEP)
    rids = [f"s0{tag}", f"s0{step_tag(OTHER)}", "eval-0", f"s1{tag}"]  # the last one waits for a row
    for rid in rids:
        engine.add_request(GenerateRequest(rid, ids, greedy(40)))
    for _ in range(5):
        engine.step()
    aborted = engine.abort_tagged(tag)
    assert [o.request_id for o in aborted] == [f"s0{tag}", f"s1{tag}"] and engine.abort_tagged(tag) == []
    assert [o.finish_reason for o in aborted] == [FinishReason.ABORT] * 2
    assert aborted[0].num_tokens == 5 and aborted[1].num_tokens == 0  # running, and still waiting
    assert len(engine.parked) == 1  # the running one's cache, for its resume
    whole = {}
    while engine.has_work():
        whole |= {o.request_id: o for o in engine.step()}
    assert sorted(whole) == sorted(rids[1:3]) and all(o.num_tokens == 40 for o in whole.values())
    assert whole[rids[1]].token_ids == whole[rids[2]].token_ids  # greedy, one prompt: one response


def test_the_simulated_engine_aborts_the_tagged_requests_running_and_waiting():
    from sim.clock import run_virtual
    from sim.engine import SimEngine
    from sim.hardware import StepCost

    flat = StepCost(0.0, ((0.01, 0.0, 0.0),), 0.0, 0.0)
    tag = step_tag(STEP)
    rids = [f"s0{tag}", f"s0{step_tag(OTHER)}", "eval-0", f"s1{tag}"]

    async def main(loop):
        e = SimEngine(flat, lambda key, input_ids: (50 - (len(input_ids) - 1), 0), max_num_seqs=3,
                      kv_capacity=10_000, max_prefill_tokens=1000)
        tasks = [asyncio.ensure_future(e.generate(GenerateRequest(rid, [0], greedy(100)))) for rid in rids]
        await asyncio.sleep(0.055)
        assert len(e.running) == 3 and len(e.waiting) == 1
        assert e.abort_tagged(tag) == 2
        return await asyncio.gather(*tasks)

    outs = run_virtual(main)
    assert [o.finish_reason for o in outs] == [FinishReason.ABORT, FinishReason.STOP, FinishReason.STOP,
                                               FinishReason.ABORT]
    assert outs[1].num_tokens == outs[2].num_tokens == 50 and outs[3].num_tokens == 0


# -- real engines: an evaluation of held-out prompts while a step interrupts ------------------------------

def held_out(cfg, encode, num: int) -> list:
    from april_ray.task import countdown

    return [(row["prompt"], encode(row["prompt"]), row["answer"], {})
            for row in countdown.generate(cfg.task, num, cfg.task.seed + 1)]


def meeting(ids: set[str], running: set[str], outputs: dict, eval_ids: set[str], step_ids: set[str]) -> bool:
    """Every request of the step and of the evaluation sent, each one finished (some responses end early)
    or `running`, and some of each running: at least 4 of the step's, so its interrupt surely finds some."""
    return (ids >= eval_ids | step_ids and all(r in running or r in outputs for r in eval_ids | step_ids)
            and len(running & step_ids) >= 4 and bool(running & eval_ids))


def running_on_cpu_engine(worker, eval_ids, step_ids):
    """`meeting`, running in the engine's batch."""
    scheduler = worker.engine.engine.engine.scheduler  # Tracked -> AsyncEngine -> LLMEngine
    running = {s.request.request_id for s in scheduler.running}
    return meeting(set(worker.engine.requests), running, worker.engine.outputs, eval_ids, step_ids)


async def evaluation_meets_interrupt(worker, items, running):
    """(the evaluation's outputs uninterrupted, its outputs under a step's interrupt, the step's samples,
    the evaluation's requests still running when it came)."""
    uninterrupted = await worker.evaluate(items, 0.0, "alone")
    samples = [Sample(f"gs{i}", "g", "p", "", items[0][1], worker.sampling.max_new_tokens) for i in range(8)]
    step_ids = {s.sample_id + step_tag(STEP) for s in samples}
    eval_ids = {f"meet-{i}" for i in range(len(items))}
    rollout = asyncio.ensure_future(worker.generate_group(samples, STEP))
    evaluation = asyncio.ensure_future(worker.evaluate(items, 0.0, "meet"))
    await until(lambda: running(worker, eval_ids, step_ids), "the evaluation and the step running together",
                over=lambda: rollout.done() or evaluation.done())
    cut = len(eval_ids - set(worker.engine.outputs))
    assert worker.abort_all(STEP) >= 4
    _, partial = await rollout
    interrupted = await evaluation
    outputs = worker.engine.outputs
    return ([outputs[f"alone-{i}"] for i in range(len(items))], [outputs[f"meet-{i}"] for i in range(len(items))],
            partial, cut, (uninterrupted, interrupted))


def check_whole(alone, met, partial, cut, results):
    assert cut > 0, "no evaluation request was running when the step was interrupted"
    assert any(s.finish_reason == FinishReason.ABORT for s in partial), "the interrupt aborted nothing of its step"
    assert [o.finish_reason for o in met] == [o.finish_reason for o in alone]
    assert all(o.finish_reason in WHOLE for o in met)
    assert [o.token_ids for o in met] == [o.token_ids for o in alone]  # greedy: the very same responses
    assert results[1] == results[0]


class Tracked(Recording):
    """Recording, and the request ids sent to the engine."""

    def __init__(self, engine):
        super().__init__(engine)
        self.requests: list[str] = []

    async def generate(self, request: GenerateRequest):
        self.requests.append(request.request_id)
        return await super().generate(request)


@pytest.fixture(scope="module")
def cfg():
    from april_ray.config import load_config

    return load_config(None, ["sampling.max_response_len=160"])


def test_an_evaluation_on_the_cpu_engine_is_whole_through_a_steps_interrupt(cfg, random_model_dir):
    """One EngineWorker of the default config (a shorter response budget) on the in-actor engine."""
    from april_ray.rollout.engine_worker import build_worker

    worker = build_worker(cfg.engine, cfg.sampling, cfg.staleness, cfg.task, str(random_model_dir))
    worker.engine = Tracked(worker.engine)
    items = held_out(cfg, worker.encode, 24)
    check_whole(*asyncio.run(evaluation_meets_interrupt(worker, items, running_on_cpu_engine)))


def running_on_server(info: dict):
    """`meeting`, in flight through the client, with the server's batch holding every call in flight (its
    /get_server_info, read by a poller meanwhile, with the requests the client had in flight when it asked)."""
    def running(worker, eval_ids, step_ids):
        in_flight = set(worker.engine.engine._rids)
        return (info.get("seen") == in_flight and info["num_calls"] == info["num_running"] == len(in_flight)
                and info["num_waiting"] == 0
                and meeting(set(worker.engine.requests), in_flight, worker.engine.outputs, eval_ids, step_ids))
    return running


@pytest.fixture(scope="module")
def http_worker(cfg, random_model_dir):
    """One EngineWorker of the default config on engine.backend=cpu_http: our CPU server in a process of its
    own, spoken to over SGLang's HTTP API (the module's HTTP tests share it)."""
    import dataclasses

    from april_ray.rollout.engine_worker import build_worker

    engine_cfg = dataclasses.replace(cfg.engine, backend="cpu_http", startup_timeout_s=300.0)
    worker = build_worker(engine_cfg, cfg.sampling, cfg.staleness, cfg.task, str(random_model_dir))
    yield worker
    worker.engine.server.stop()


def test_an_evaluation_over_http_is_whole_through_a_steps_interrupt(cfg, http_worker):
    """The same on our CPU server: the client aborts the step's requests by rid."""
    worker, client = http_worker, http_worker.engine
    worker.engine = Tracked(client)
    items = held_out(cfg, worker.encode, 24)
    info: dict = {}

    async def main():
        async def poll():  # the server's batch, with the requests in flight when it was asked
            while True:
                seen = set(client._rids)
                info.update(await client.request("GET", "/get_server_info"), seen=seen)
                await asyncio.sleep(0.01)

        poller = asyncio.ensure_future(poll())
        try:
            return await evaluation_meets_interrupt(worker, items, running_on_server(info))
        finally:
            poller.cancel()
            await client.close()

    try:
        check_whole(*asyncio.run(main()))
    finally:
        worker.engine = client


async def server_runs(client, num_calls: int):
    """Until the server's batch holds `num_calls` calls, each generating."""
    async def info():
        return await client.request("GET", "/get_server_info")

    state = await info()
    while not state["num_calls"] == state["num_running"] == num_calls:
        await asyncio.sleep(0.005)
        state = await info()


def hold_late_request(client, request_id: str) -> None:
    """`request_id`'s /generate reaches the server only once its first abort was answered (SGLang drops an
    abort of a rid it does not know yet): only a re-sent abort can stop it."""
    request, aborted = client.request, asyncio.Event()

    async def held(method, path, body=None, **kw):
        late = body is not None and str(body.get("rid", "")).endswith(request_id)
        if late and path == "/generate":
            await aborted.wait()
        out = await request(method, path, body, **kw)
        if late and path == "/abort_request":
            aborted.set()
        return out

    client.request = held


def test_the_client_aborts_a_steps_requests_by_rid_also_one_that_reaches_the_server_after_its_abort(http_worker):
    from april_ray.engine.sglang_client import SGLangEngine

    srv, ids = http_worker.engine.server, http_worker.encode("0052-3:")
    mine = [GenerateRequest(f"s{i}{step_tag(STEP)}", ids, greedy(400)) for i in range(2)]
    others = [GenerateRequest(f"s0{step_tag(OTHER)}", ids, greedy(400)), GenerateRequest("eval-0", ids, greedy(400))]

    async def main():
        client = SGLangEngine(srv.url, max_model_len=http_worker.engine.max_model_len, server=srv)
        try:
            tasks = [asyncio.ensure_future(client.generate(r)) for r in mine + others]
            await server_runs(client, 4)
            assert client.abort_tagged(step_tag(STEP)) == 2
            aborted = await asyncio.gather(*tasks[:2])
            hold_late_request(client, f"s2{step_tag(STEP)}")
            late = asyncio.ensure_future(client.generate(GenerateRequest(f"s2{step_tag(STEP)}", ids, greedy(400))))
            await asyncio.sleep(0)  # the call is in flight, its request held back until its abort has been answered
            assert client.abort_tagged(step_tag(STEP)) == 1
            return aborted, await late, await asyncio.gather(*tasks[2:])
        finally:
            await client.close()

    aborted, late, whole = asyncio.run(main())
    assert all(o.finish_reason == FinishReason.ABORT and o.num_tokens < 400 for o in aborted + [late])
    assert all(o.finish_reason in WHOLE for o in whole)
    assert whole[0].token_ids == whole[1].token_ids  # greedy, the same prompt: the very same response


def test_the_server_aborts_as_sglang_does_a_rid_it_knows_and_every_rid_that_begins_with_it(http_worker):
    """SGLang forwards an abort only for a rid it has, and its scheduler then aborts every request whose rid
    begins with it: an unknown prefix and an empty rid abort nothing."""
    from april_ray.engine.sglang_client import SGLangEngine

    srv, ids = http_worker.engine.server, http_worker.encode("0052-3:")

    async def main():
        client = SGLangEngine(srv.url, server=srv)

        async def generate(rid):
            body = {"rid": rid, "input_ids": ids, "sampling_params": {"max_new_tokens": 400, "temperature": 0}}
            return (await client.request("POST", "/generate", body))["meta_info"]["finish_reason"]["type"]

        try:
            calls = [asyncio.ensure_future(generate(rid)) for rid in ("abc", "abcd", "xyz")]
            await server_runs(client, 3)
            await client.request("POST", "/abort_request", {"rid": "ab"})
            await client.request("POST", "/abort_request", {"rid": ""})
            untouched = (await client.request("GET", "/get_server_info"))["num_calls"]
            await client.request("POST", "/abort_request", {"rid": "abc"})
            return untouched, await asyncio.gather(*calls)
        finally:
            await client.close()

    untouched, reasons = asyncio.run(main())
    assert untouched == 3 and reasons[:2] == ["abort", "abort"] and reasons[2] in ("stop", "length")
