"""A job restored in place when an actor other than an engine dies (driver/restore.py): what a restored store
gives back keeps every field, the line that stops the job, and a short job on a local Ray whose completion
monitor and learner rank are SIGKILLed."""
import asyncio
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from april_ray.rollout.local import LocalProxy
from april_ray.rollout.store import PartialRolloutStore, held, sample_from_json, sample_to_json
from april_ray.types import FinishReason, Group, Sample, SampleState
from driver.checkpoint import rollout_state, write_checkpoint
from tests.chaos_asserts import assert_chaos_ok
from tests.conftest import USER_ENV
from tests.prefetch import shared_job

ROOT = Path(__file__).resolve().parents[1]


def finished(sid: str, gid: str = "e0p0", reward_error: str | None = None) -> Sample:
    return Sample(sid, gid, "1 2", "3", [1, 2], 8, response_ids=[5, 6], logprobs=[-0.5, -0.25], versions=[0, 1],
                  state=SampleState.FINISHED, finish_reason=FinishReason.STOP, reward=0.0, reward_error=reward_error)


def test_every_field_of_a_sample_survives_the_stores_json():
    """Every field set to something other than its default comes back: a field the JSON leaves out fails."""
    sample = Sample("e0p0s0", "e0p0", "1 2", "3", [1, 2], 8, response_ids=[5, 6, 7], logprobs=[-0.5, 0.0, -0.25],
                    versions=[0, -1, 1], loss_mask=[1, 0, 1], episode={"turn": 2, "state": {"x": 1}},
                    metadata={"level": 3}, state=SampleState.PARTIAL, finish_reason=FinishReason.ABORT, reward=0.5,
                    num_resumes=2, num_discarded_tokens=4, reward_error="task.reward_fn timed out")
    defaults = Sample("s", "g", "", "", [], 1)
    for f in dataclasses.fields(Sample):
        assert getattr(sample, f.name) != getattr(defaults, f.name), f"set {f.name} in this test"
    assert sample_from_json(json.loads(json.dumps(sample_to_json(sample))), "store") == sample


def test_a_finished_sample_taken_back_from_a_restored_store_keeps_its_reward_error():
    """The reward error is in the engine's meta alone; the monitor hands it to the store with the group, and
    a store rebuilt from a checkpoint's JSON gives it back in the meta (it once came back as None)."""
    store = PartialRolloutStore()
    group = Group("e0p0", 0, [finished("e0p0s0", reward_error="task.reward_fn: boom"), finished("e0p0s1")])
    asyncio.run(LocalProxy(store).put_complete([group], {"e0p0s0": "task.reward_fn: boom"}))
    restored = PartialRolloutStore()
    restored.load_state_dict(json.loads(json.dumps(store.state_dict())), "store")
    [back] = restored.take_complete()
    metas = held(back, back.samples).metas
    assert [m.reward_error for m in metas] == ["task.reward_fn: boom", None]


def test_a_job_that_cannot_go_on_stops_with_one_line_naming_what_died_and_how_to_resume(tmp_path):
    from driver.restore import Restorer

    run = SimpleNamespace(out=tmp_path, lock=SimpleNamespace(run="r1"), start=0)
    restorer = Restorer(SimpleNamespace(), run, tracker=None)
    err = restorer.stopped("step 7: learner rank 0 died after 3 restores (train.max_restores=3)")
    assert "\n" not in str(err) and "learner rank 0 died" in str(err)
    assert f"python -m jobs.train --config {tmp_path / 'config.yaml'} train.resume=true" in str(err)
    assert "from step 0 (no checkpoint yet)" in str(err)
    store = PartialRolloutStore()
    state = rollout_state(4, 5, {"epoch": 0, "position": 8, "num_examples": 10, "seed": 0}, store.state_dict(),
                          {"returned_groups": 4, "dropped_groups": 0})
    write_checkpoint(tmp_path, state, lambda d: (Path(d) / "weights.json").write_text("{}"), "r1")
    assert "goes on from ckpt-000004" in str(restorer.stopped("step 7: the prompt source died"))


def test_weights_of_the_checkpoints_older_version_drop_every_parked_kv_cache(policy):
    """A restore sends the engines the checkpoint's policy under its version, below theirs. A cache parked
    under a newer version was computed by weights the job no longer has, and one labelled with the
    checkpoint's version (its prefill's) may hold positions a newer one computed: both once passed as
    usable (a negative age is within any bound), and a resume reused them."""
    from april_ray.engine.cpu_engine import LLMEngine
    from april_ray.types import GenerateRequest, SamplingParams

    model, tok = policy
    engine = LLMEngine(model, max_num_seqs=2, max_model_len=128, num_park_slots=2, version=5, max_versions=2)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40)
    a, b = GenerateRequest("a", tok.encode("0052-3:"), greedy), GenerateRequest("b", tok.encode("12-1:"), greedy)
    engine.add_request(a)
    for version in (5, 6):  # a's prefill by version 5, its later positions by version 6
        engine.update_weights(None, version)
        for _ in range(3):
            engine.step()
    part_a = engine.abort("a")
    engine.update_weights(None, 7)
    engine.add_request(b)
    for _ in range(3):
        engine.step()
    part_b = engine.abort("b")
    resumes = [a.input_ids + part_a.token_ids, b.input_ids + part_b.token_ids]
    assert [engine.parked.usable(ids, 7) is not None for ids in resumes] == [True, True]
    reused = engine.stats().num_reused_tokens
    engine.update_weights(None, 5)  # the restore
    assert engine.stats().num_parked == 0
    engine.generate([GenerateRequest(f"{r}2", ids, greedy) for r, ids in zip("ab", resumes)])
    assert engine.stats().num_reused_tokens == reused
    engine.update_weights(None, 6)  # the steps redone: forward again, and parking as before
    engine.add_request(GenerateRequest("c", a.input_ids, greedy))
    engine.step()
    engine.abort("c")
    assert engine.stats().num_parked == 1


def test_the_summarys_history_keeps_one_evaluation_per_step_the_redone_one():
    """Evaluations after steps 2 and 4, a restore to the checkpoint after step 3, step 4 redone: the summary
    once listed step 4's abandoned evaluation too, and `jobs.bench.train` paired its points with the wrong steps."""
    from driver.evaluator import EvalHistory

    history = EvalHistory()
    history.add(0, 0.0, 0.1)
    history.add(2, 10.0, 0.2)
    history.add(4, 20.0, 0.3)  # abandoned: its step is redone
    history.add(4, 31.0, 0.35)
    history.add(6, 40.0, 0.4)
    assert history.points() == [(0.0, 0.1), (10.0, 0.2), (31.0, 0.35), (40.0, 0.4)]


class Handle:
    """An actor handle as `Restorer.dead_actors` reads it: an id, and a ping this test refuses."""

    def __init__(self, actor_id: str):
        self._actor_id = SimpleNamespace(hex=lambda: actor_id)
        self.__ray_ready__ = SimpleNamespace(remote=self.ping)

    def ping(self):
        raise AssertionError("pinged: the error named the dead actor")


def test_the_dead_actor_an_error_names_is_restored_without_a_ping(monkeypatch):
    """Every caught error once pinged every actor, waiting up to 60 s for each one busy (a learner rank in a
    collective its dead peer left). A death the error names, itself or as the cause of the caller's error,
    needs no ping; an error that names none pings them all, once."""
    from ray.exceptions import ActorDiedError, RayTaskError

    import driver.restore as restore

    rollout = SimpleNamespace(monitor=Handle("m"), store=Handle("s"), source=Handle("p"))
    run = SimpleNamespace(out=None, lock=None, start=0, rollout=rollout,
                          learners=SimpleNamespace(actors=[Handle("l0"), Handle("l1")]))
    restorer = restore.Restorer(SimpleNamespace(), run, tracker=None)
    died = ActorDiedError()
    died.actor_id = "s"
    via_monitor = RayTaskError("step", "Traceback ...", died).as_instanceof_cause()
    assert restorer.dead_actors(died) == restorer.dead_actors(via_monitor) == ["the partial-rollout store"]
    engine = ActorDiedError()
    engine.actor_id = "an engine's"
    pinged = []
    monkeypatch.setattr(restore, "unanswered", lambda named, timeout_s: pinged.append(named) or ["learner rank 1"])
    assert restorer.dead_actors(engine) == restorer.dead_actors(ValueError("the job's own")) == ["learner rank 1"]
    assert [[name for name, _ in named] for named in pinged] == [[
        "the completion monitor", "the partial-rollout store", "the prompt source", "learner rank 0",
        "learner rank 1"]] * 2


def users_line(e: Exception) -> str | None:
    from jobs.train import users_error

    return users_error(e)


def test_the_training_command_prints_the_stop_as_its_one_line(tmp_path):
    from driver.restore import JobStopped

    assert users_line(JobStopped("step 3: the completion monitor died ...")) == "step 3: the completion monitor died ..."


@shared_job
def chaos_actor_kills(tmp_path_factory, model_dir):
    """8 steps, a checkpoint every 2; the completion monitor and a learner rank SIGKILLed once each."""
    tmp = tmp_path_factory.mktemp("chaos_actors")
    out = tmp / "chaos.json"
    cmd = [sys.executable, "-m", "jobs.chaos", "--config", "configs/tiny_cpu.yaml", "--kill-actors", "monitor,learner",
           "--seed", "3", "--json", str(out), f"model.path={model_dir}", f"model.cache_dir={tmp}",
           f"train.output_dir={tmp}/out", "task.num_train=300", "task.num_eval=16", "train.num_steps=8",
           "train.eval_every=4", "train.save_every=2", "rollout.rollout_batch_size=4",
           "rollout.over_sampling_batch_size=8", "rollout.n_samples_per_prompt=4", "sampling.max_response_len=64",
           "engine.max_model_len=128", "staleness.max_versions=1", "algorithm.overlong_buffer=8",
           "logging.dashboard=false", "learner.backend=torch"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**USER_ENV, "RAY_ADDRESS": ""}, capture_output=True, text=True,
                          timeout=900)
    return proc, out, tmp / "out"


@pytest.mark.slow
def test_a_killed_monitor_and_learner_are_restored_in_place_losing_and_repeating_nothing(chaos_actor_kills):
    proc, out, run_dir = chaos_actor_kills
    r = assert_chaos_ok(proc, out, kills=2, steps=8, bound=1)
    assert sorted(k["actor"] for k in r["actor_kills"]) == ["learner", "monitor"]
    assert r["restores"] == 2 and all(k["restored"] and k["recovery_s"] is not None for k in r["actor_kills"])
    for kill in r["actor_kills"]:  # redone: the steps after the checkpoint it went back to, no more
        ckpt_step = int(kill["checkpoint"].rsplit("-", 1)[1]) if kill["checkpoint"] else -1
        assert all(ckpt_step < s <= kill["failed_at_step"] for s in kill["redone_steps"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "train/version" in r]
    assert steps == list(range(8)) and [r["train/version"] for r in rows if "train/version" in r] == list(range(1, 9))


def test_the_tracker_cut_back_to_a_checkpoint_goes_on_appending_after_it(tmp_path):
    """A restore in place cuts metrics.jsonl while the tracker holds it open: its next rows follow the kept ones."""
    from april_ray.config import Config, LoggingConfig
    from april_ray.tracking import Tracker

    cfg = dataclasses.replace(Config(), logging=dataclasses.replace(LoggingConfig(), wandb_mode="disabled",
                                                                     tensorboard=False))
    tracker = Tracker(cfg, tmp_path, total_steps=6)
    for step in range(4):
        tracker.log(step, {"train/version": step + 1})
    tracker.cut_back(tmp_path, 1)
    tracker.log(2, {"train/version": 3})
    tracker.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["train/version"]) for r in rows] == [(0, 1), (1, 2), (2, 3)]
