"""Tool calls of episodes without Ray: a result belongs to the trajectory that asked for it (a restarted sample,
a replay with other tokens, a redone step after a resume each get their own), a replay of the same trajectory
is answered from the journal with the same idempotency key, plain tools run off the engine's loop under the
timeout, and no call starts once the job's driver is gone."""
import asyncio
import os
import random
import subprocess
import sys
import time

import pytest

from actors.journal import ProcessWatch
from april_ray.rollout.engine_worker import EngineWorker
from april_ray.rollout.episode import ToolCallsStopped, ToolJournal
from april_ray.task.tokenizer import build_tokenizer
from april_ray.types import EngineStats, FinishReason, GenerateOutput, Sample, SamplingParams

TOK = build_tokenizer()
ALPHABET = TOK.encode("abcdefgh")
QUESTION = TOK.encode("?")[-1]


def digest(ids) -> int:
    """The tool's answer: a function of the whole trajectory before the call."""
    return sum((i + 1) * t for i, t in enumerate(ids)) % 9973


class SeededEngine:
    """Random letters from a seed of its own; each turn ends at `?` after 2-5 letters, the third at EOS."""

    def __init__(self, seed: int):
        self.rng, self.requests = random.Random(seed), []

    async def generate(self, req):
        self.requests.append(req)
        await asyncio.sleep(0)
        turns = TOK.decode(req.input_ids).count("?")
        out = [self.rng.choice(ALPHABET) for _ in range(self.rng.randint(2, 5))]
        out.append(QUESTION if turns < 2 else TOK.eos_token_id)
        out = out[:req.sampling.max_new_tokens]
        return GenerateOutput(req.request_id, out, [-0.1] * len(out), [0] * len(out), FinishReason.STOP)

    def abort_tagged(self, tag):
        return 0

    def abort_all(self):
        return 0

    def stats(self, drain=True):
        return EngineStats(0, 0, 0.0, 0, 0, 0, [])


class Tool:
    """`digest` of the ids it is given, logging every run with its idempotency key."""

    def __init__(self, sleep_s: float = 0.0):
        self.runs, self.sleep_s = [], sleep_s

    def __call__(self, ids, idempotency_key):
        self.runs.append(idempotency_key)
        time.sleep(self.sleep_s)
        return digest(ids)


def agent(tool, seen):
    async def episode(ep):
        while True:
            text = await ep.generate(stop=("?",))
            if not text.endswith("?"):
                return 1.0
            before = list(ep.sample.input_ids)
            got = await ep.call_tool("digest", tool, before)
            seen.append((ep.sample.sample_id, got, digest(before)))
            ep.append_env(str(got))
    return episode


def worker_for(seed, journal, episode, tool_timeout_s=5.0):
    sp = SamplingParams(temperature=1.0, max_new_tokens=64, stop_token_ids=(TOK.eos_token_id,))
    worker = EngineWorker(SeededEngine(seed), lambda ids: TOK.decode(ids, skip_special_tokens=True),
                          lambda *a: 0.0, sp, TOK.encode)
    worker.use_episodes(episode, journal, max_model_len=256, tool_timeout_s=tool_timeout_s)
    return worker


def fresh(sid="e0p0s0"):
    return Sample(sid, "e0p0", "q:", "", TOK.encode("q:"), 64)


def run(worker, sample):
    [meta], [s] = asyncio.run(worker.generate_group([sample], ("run", 0)))
    return meta, s


def test_a_restarted_or_redone_trajectory_gets_its_own_results_and_a_replay_reuses_them(tmp_path):
    """One sample id, one journal file: a first trajectory, the same sample from its prompt with other tokens
    (a staleness restart, or a step redone after a resume that reopened the file), then the first trajectory
    replayed token for token. Every result equals the tool's answer for the trajectory that received it; the
    replay runs nothing, with the keys of the first."""
    path, tool, seen = tmp_path / "journal.jsonl", Tool(), []
    first_worker = worker_for(1, ToolJournal(path), agent(tool, seen))
    run(first_worker, fresh())
    first = list(tool.runs)
    assert len(first) == 2 and len(set(first)) == 2
    run(worker_for(2, ToolJournal(path), agent(tool, seen)), fresh())  # restarted: another trajectory
    assert len(tool.runs) == 4 and not set(tool.runs[2:]) & set(first)
    replayer = worker_for(1, ToolJournal(path), agent(tool, seen))
    _, replay = run(replayer, fresh())  # the first one, again
    assert len(tool.runs) == 4 and replay.reward == 1.0
    stats, again = first_worker.stats(), replayer.stats()  # the step's metrics: rollout/tool_*
    assert (stats.tool_calls, stats.tool_replays, again.tool_calls, again.tool_replays) == (2, 0, 0, 2)
    assert len(seen) == 6 and all(got == right for _, got, right in seen)
    assert all(key.startswith("e0p0s0/") and len(key.split("/")) == 5 for key in tool.runs)


def test_an_unjournaled_call_runs_again_with_the_same_idempotency_key():
    """A call whose result never reached the journal (the job died first) runs again when its trajectory is
    replayed, with the same key: what a tool with side effects dedupes on."""
    tool, seen = Tool(), []
    run(worker_for(1, ToolJournal(), agent(tool, seen)), fresh())
    run(worker_for(1, ToolJournal(), agent(tool, seen)), fresh())  # a journal that lost everything
    assert len(tool.runs) == 4 and tool.runs[:2] == tool.runs[2:]


def test_a_plain_tool_runs_off_the_loop_and_under_the_timeout():
    """A blocking `def` tool: the loop goes on meanwhile (another coroutine ticks), and past
    rollout.tool_timeout_s the episode gets a TimeoutError naming the key (it fails, unscored)."""
    ticks, during = [0], []

    class Slow(Tool):
        def __call__(self, ids, idempotency_key):
            start = ticks[0]
            out = super().__call__(ids, idempotency_key)
            during.append(ticks[0] - start)
            return out

    async def ticking(worker):
        async def tick():
            while True:
                ticks[0] += 1
                await asyncio.sleep(0.001)
        t = asyncio.ensure_future(tick())
        try:
            return await worker.generate_group([fresh()], ("run", 0))
        finally:
            t.cancel()

    seen = []
    worker = worker_for(1, ToolJournal(), agent(Slow(sleep_s=0.2), seen))
    [meta], [s] = asyncio.run(ticking(worker))
    assert meta.error is None and s.reward == 1.0 and all(n > 0 for n in during) and len(during) == 2
    assert worker.tool_stats().calls == 2

    worker = worker_for(1, ToolJournal(), agent(Tool(sleep_s=1.0), []), tool_timeout_s=0.05)
    meta, _ = run(worker, fresh())
    assert "TimeoutError: tool 'digest': no result within rollout.tool_timeout_s=0.05s" in meta.error
    assert worker.tool_stats().errors == 1


def test_an_async_tool_and_a_plain_function_returning_a_coroutine_are_awaited():
    async def atool(ids):
        await asyncio.sleep(0)
        return digest(ids)

    for tool in (atool, lambda ids: atool(ids)):
        seen = []
        meta, s = run(worker_for(3, ToolJournal(), agent(tool, seen)), fresh())
        assert meta.error is None and len(seen) == 2 and all(g == r for _, g, r in seen)


def test_no_new_call_starts_once_the_driver_is_gone_but_recorded_results_are_answered(tmp_path):
    path, tool, seen = tmp_path / "journal.jsonl", Tool(), []
    run(worker_for(1, ToolJournal(path), agent(tool, seen)), fresh())
    closed = ToolJournal(path, calls_open=lambda: False)
    meta, _ = run(worker_for(1, closed, agent(tool, seen)), fresh())  # a replay: answered from the file
    assert meta.error is None and len(tool.runs) == 2
    meta, _ = run(worker_for(2, closed, agent(tool, seen)), fresh())  # a new trajectory: refused, not run
    assert "ToolCallsStopped" in meta.error and len(tool.runs) == 2
    with pytest.raises(ToolCallsStopped):
        asyncio.run(closed.begin("x/1/0/h/digest"))
    evaluating = worker_for(2, closed, agent(tool, seen))  # evaluation's own journal asks the job's too
    [(reward, _)] = asyncio.run(evaluating.evaluate([("q", TOK.encode("q:"), "", {})], 1.0, "eval"))
    assert reward == 0.0 and len(tool.runs) == 2


def test_the_watch_sees_a_killed_process_go():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watch = ProcessWatch(proc.pid)
    assert watch() and ProcessWatch(None)()
    proc.kill()
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped: a zombie, gone already
    assert not watch()
    proc.wait()
    assert not watch() and not ProcessWatch(proc.pid)()


def test_max_turns_and_the_env_token_cap():
    seen = []
    sp = SamplingParams(temperature=1.0, max_new_tokens=64, stop_token_ids=(TOK.eos_token_id,))
    worker = EngineWorker(SeededEngine(1), lambda ids: TOK.decode(ids, skip_special_tokens=True),
                          lambda *a: 0.0, sp, TOK.encode)

    async def chatty(ep, reply):
        while True:
            text = await ep.generate(stop=("?",))
            if not text.endswith("?"):
                return float(ep.turn)
            seen.append(text)
            ep.append_env(reply)

    worker.use_episodes(chatty, ToolJournal(), max_model_len=256, tool_timeout_s=5.0, kwargs={"reply": "abcdefgh"},
                        max_turns=2, max_env_tokens=3)
    _, s = run(worker, fresh())
    assert s.reward == 2.0 and len(seen) == 2 and s.episode["turn"] == 2
    assert TOK.decode([t for t, m in zip(s.response_ids, s.loss_mask) if not m]) == "abcabc"
