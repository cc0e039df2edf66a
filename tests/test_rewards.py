"""Rewards by path (`task.reward_fn`) and by URL (`task.reward_url`), under today's rule: a reward that
raises, hangs or returns no number scores 0 and is counted. The functions live outside the repository
(tmp_path, imported by module:function) and the reward server is a real HTTP server on loopback."""
import asyncio
import contextlib
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from april_ray.config import ConfigError, TaskConfig, load_config
from april_ray.task.rewards import RewardRunner, RewardServerError, UrlReward, build_reward_fn

USER_REWARDS = '''
import asyncio, json, os

def score(prompt, response, answer, metadata):
    return float(len(response)) + metadata.get("bonus", 0)

async def ascore(prompt, response, answer, metadata):
    await asyncio.sleep(0)
    return 0.5

def three(prompt, response, answer):
    return 2.0

def boom(prompt, response, answer, metadata):
    raise RuntimeError("bad reward")

def text(prompt, response, answer, metadata):
    return "high"

def numeric_text(prompt, response, answer, metadata):
    return "0.5"

def yes(prompt, response, answer, metadata):
    return True

def two(prompt, response):
    return 1.0

def plain_episode(ep):
    return None

async def episode(ep, level=1):
    return None

def broken_import():
    pass

async def hang(prompt, response, answer, metadata):
    await asyncio.sleep(60)

not_a_function = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_rewards.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_rewards"
    sys.modules.pop("user_rewards", None)


def run(coro):
    return asyncio.run(coro)


def runner(spec: str, timeout_s: float = 5.0) -> RewardRunner:
    return RewardRunner(build_reward_fn(TaskConfig(reward_fn=spec)), timeout_s, log=lambda *_: None)


def test_reward_by_path_gets_the_metadata_sync_or_async(user_module):
    assert run(runner(f"{user_module}:score")("p", "abc", "a", {"bonus": 10})) == 13.0
    assert run(runner(f"{user_module}:ascore")("p", "abc", "a", {})) == 0.5
    assert run(runner(f"{user_module}:three")("p", "abc", "a", {"x": 1})) == 2.0  # no metadata parameter


@pytest.mark.parametrize("name", ["boom", "text", "hang", "numeric_text", "yes"])
def test_reward_that_raises_hangs_or_returns_no_number_scores_zero_and_is_counted(user_module, name):
    r = runner(f"{user_module}:{name}", timeout_s=0.5)
    assert run(r("p", "abc", "a", {})) == 0.0
    assert r.drain_errors() == 1 and r.drain_errors() == 0


def test_reward_path_errors_name_the_key(user_module):
    with pytest.raises(ValueError, match="task.reward_fn: cannot import 'nowhere_mod'.*PYTHONPATH"):
        build_reward_fn(TaskConfig(reward_fn="nowhere_mod:score"))
    with pytest.raises(ValueError, match="task.reward_fn: module 'user_rewards' .* has no 'missing'"):
        build_reward_fn(TaskConfig(reward_fn=f"{user_module}:missing"))
    with pytest.raises(ValueError, match="not a function"):
        build_reward_fn(TaskConfig(reward_fn=f"{user_module}:not_a_function"))
    from driver.setup import prepare

    with pytest.raises(ValueError, match="task.reward_fn: cannot import 'nowhere_mod'"):  # the job stops at start
        prepare(load_config(None, ["task.reward_fn=nowhere_mod:score", "model.path=/nonexistent"]))
    with pytest.raises(ConfigError, match="task.reward_fn: expected module:function"):
        load_config(None, ["task.reward_fn=just_a_module"])
    with pytest.raises(ConfigError, match="task.reward_url: set either"):
        load_config(None, ["task.reward_fn=a:b", "task.reward_url=http://127.0.0.1:1/"])
    with pytest.raises(ConfigError, match="task.reward_url: expected an http"):
        load_config(None, ["task.reward_url=127.0.0.1:8000"])


def test_builtin_reward_after_think():
    math_cfg = TaskConfig(name="math", reward_after_think=True)
    fn = build_reward_fn(math_cfg)
    assert fn("", "<think>maybe $7$</think> so the answer is $\\frac{1}{2}$", "1/2", {}) == 1.0
    assert fn("", "<think>a</think>$7$<think>b</think>$\\frac{1}{2}$", "7", {}) == 0.0  # after the LAST one
    assert fn("", "so the answer is $\\frac{1}{2}$", "1/2", {}) == 0.0  # never left its thoughts
    assert build_reward_fn(TaskConfig(name="math"))("", "<think>$3$</think> $\\frac{1}{2}$", "1/2", {}) == 1.0
    countdown = build_reward_fn(TaskConfig(reward_after_think=True))
    assert countdown("0006-3:", "<think>hm</think> 0003 0000", "", {}) == 1.0


class RewardServer:
    """A served reward model on loopback: /ok scores len(response) + metadata bonus, /slow never answers in
    time, /error answers 500 (each hit counted), /flaky 500 once then ok, /nan a body with no number."""

    def __init__(self):
        self.hits: dict[str, int] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                n = server.hits[self.path] = server.hits.get(self.path, 0) + 1
                if self.path == "/slow":
                    time.sleep(1.0)
                if self.path == "/error" or (self.path == "/flaky" and n == 1):
                    return self._send(500, b"model crashed")
                if self.path == "/nan":
                    return self._send(200, b'{"score": "good"}')
                if self.path == "/bad-request":
                    return self._send(400, b"missing field")
                reward = len(body["response"]) + body["metadata"].get("bonus", 0)
                self._send(200, json.dumps({"reward": reward} if self.path != "/bare" else reward).encode())

            def _send(self, code, data):
                with contextlib.suppress(BrokenPipeError):  # /slow: the client gave up
                    self.send_response(code)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def server():
    s = RewardServer()
    yield s
    s.httpd.shutdown()


def test_reward_url_posts_json_and_reads_a_number(server):
    assert UrlReward(server.url + "/ok", 5, 0)("p", "abcd", "a", {"bonus": 1}) == 5.0
    assert UrlReward(server.url + "/bare", 5, 0)("p", "ab", "a", {}) == 2.0
    assert UrlReward(server.url + "/flaky", 5, 2)("p", "ab", "a", {}) == 2.0  # a 5xx is retried
    r = RewardRunner(build_reward_fn(TaskConfig(reward_url=server.url + "/ok")), 5, log=lambda *_: None)
    assert run(r("p", "abc", "a", {"bonus": 2})) == 5.0 and r.errors == 0


def test_reward_url_failures_name_the_url_retry_boundedly_and_score_zero(server):
    with pytest.raises(RewardServerError, match=r"task.reward_url .*/error: HTTP 500: 'model crashed' \(after 3 of 3"):
        UrlReward(server.url + "/error", 5, 2)("p", "r", "a", {})
    assert server.hits["/error"] == 3
    with pytest.raises(RewardServerError, match="HTTP 400.*after 1 of 3"):  # the request's fault: no retry
        UrlReward(server.url + "/bad-request", 5, 2)("p", "r", "a", {})
    with pytest.raises(RewardServerError, match="timed out.*after 2 of 2"):
        UrlReward(server.url + "/slow", 0.2, 1)("p", "r", "a", {})
    with pytest.raises(RewardServerError, match=r"expected a number or \{\"reward\": number\}"):
        UrlReward(server.url + "/nan", 5, 0)("p", "r", "a", {})
    logged = []
    r = RewardRunner(UrlReward(server.url + "/error", 5, 0), 5, log=logged.append)
    assert run(r("p", "r", "a", {})) == 0.0 and r.drain_errors() == 1
    assert "task.reward_url" in logged[0] and "HTTP 500" in logged[0]


def test_reward_url_refused_connection_is_an_error_naming_the_url():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RewardServerError, match=f"127.0.0.1:{port}.*refused"):
        UrlReward(f"http://127.0.0.1:{port}/", 1, 0)("p", "r", "a", {})



def test_a_reward_is_a_finite_real_number_on_every_path():
    import numpy as np

    from april_ray.task.rewards import reward_value

    assert reward_value(1) == 1.0 and reward_value(np.float32(0.5)) == 0.5 and reward_value(np.int64(2)) == 2.0
    for bad in ("0.5", True, None, float("nan"), [1.0], b"1"):
        with pytest.raises(ValueError, match="not a finite real number"):
            reward_value(bad)
    group = RewardRunner(lambda p, r, a, m: ["0.5", 1.0], 5.0, log=lambda *_: None)
    assert run(group.group(["p", "p"], ["x", "y"], ["", ""], [{}, {}])) == [0.0, 0.0] and group.errors == 2


@pytest.mark.parametrize("overrides,message", [
    (["task.reward_fn=nowhere_mod:score"], r"^task\.reward_fn: cannot import 'nowhere_mod'"),
    (["task.reward_fn=user_rewards:missing"], r"^task\.reward_fn: module 'user_rewards' \(.*user_rewards\.py\) has no"),
    (["task.reward_fn=user_rewards:two"], r"^task\.reward_fn: two\(prompt, response\) in .*user_rewards\.py cannot"),
    (["rollout.episode_fn=user_rewards:plain_episode"],
     r"^rollout\.episode_fn: plain_episode\(ep\) in .*user_rewards\.py is a plain function; an episode must be"),
    (["rollout.episode_fn=user_rewards:episode", "rollout.episode_kwargs={colour: red}"],
     r"^rollout\.episode_fn: episode\(ep, level=1\) in .*user_rewards\.py cannot be called with the episode "
     r"handle and the keywords \['colour'\]"),
])
def test_plugins_are_checked_at_config_time_naming_the_key_and_the_file(user_module, overrides, message):
    from april_ray.plugins import check_plugins

    with pytest.raises(ConfigError, match=message) as e:
        check_plugins(load_config(None, overrides))
    assert "\n" not in str(e.value)
    check_plugins(load_config(None, ["rollout.episode_fn=user_rewards:episode", "rollout.episode_kwargs={level: 2}",
                                     "task.reward_fn=user_rewards:three"]))
