import functools
import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
USER_ENV = dict(os.environ)
"""The environment pytest was started in: what a user's job would get. A test that starts a job in a
subprocess passes this (`user_env`), not the test process's, which importing `jobs` has changed."""

os.environ.setdefault("WANDB_MODE", "offline")
# Ray started inside the test process is set up as a job sets it up (jobs/env.py), before a test imports Ray
import jobs  # noqa: E402,F401
from tests.local_job import Run  # noqa: E402
from tests.prefetch import shared_job  # noqa: E402


@pytest.fixture
def user_env():
    """The user's environment for a job started in a subprocess, which starts its own local Ray."""
    return {**USER_ENV, "RAY_ADDRESS": ""}


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory):
    """A randomly initialised tiny Qwen3 + char tokenizer, saved as an HF directory (engine tests)."""
    from april_ray.config import ModelConfig
    from april_ray.model import build_random_model
    from april_ray.task.tokenizer import build_tokenizer

    out = tmp_path_factory.mktemp("random-model")
    tok = build_tokenizer()
    model = build_random_model(ModelConfig(num_layers=2), len(tok), tok.pad_token_id, tok.eos_token_id, seed=3)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture
def policy(random_model_dir):
    from april_ray.model import load_policy

    return load_policy(random_model_dir)


_EXIT_STATUS = {}
_PREFETCH = []


def pytest_terminal_summary(terminalreporter):
    """When each shared job ran (tests/prefetch.py) and how long its readers waited: a job that ends after
    the other tests did is what the run's end waits for."""
    if _PREFETCH and _PREFETCH[0].times:
        terminalreporter.write_sep("=", "shared jobs (seconds from the session's start)")
        for line in _PREFETCH[0].report():
            terminalreporter.write_line(line)


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS["code"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Exit with the session's status once everything is reported, without the interpreter's finalization.
    The suite's process hosts native runtimes that tests start in it (Ray's core worker, gloo groups, torch's
    thread pools); tearing them down at exit once segfaulted after a passing run's summary (exit 139)."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_EXIT_STATUS.get("code", 1))


def pytest_collection_modifyitems(config, items):
    """GPU tests are skipped without a GPU. The tests that read a shared job run after all the others, in
    their order: meanwhile the others keep the foreground busy while the jobs run (tests/prefetch.py)."""
    from tests.prefetch import JOBS, wanted

    items.sort(key=lambda item: bool(wanted(item) & JOBS.keys()))
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        skip = pytest.mark.skip(reason="needs a GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@shared_job(runs=2)
def two_rank_run(tmp_path_factory, model_dir):
    """tiny_cpu.yaml with two DeepSpeed ZeRO-2 learner ranks over gloo, three steps, then resumed to six in
    the same output directory: test_train_job checks its training and the resume (`resumed_run`),
    test_listeners the sockets the first job's processes listened on (rank 0 hosts the rendezvous store),
    with the hostname resolving to the machine's LAN address where that can be arranged."""
    from tests.local_job import SMALL, on_lan_hostname, run_job, train_command

    tmp = tmp_path_factory.mktemp("two-rank-job")
    out = tmp / "out"
    first, address = on_lan_hostname(train_command(
        "configs/tiny_cpu.yaml", model_dir, tmp, *SMALL, "train.eval_every=2", "train.save_every=2",
        "train.num_steps=3", "learner.num_ranks=2", "learner.zero_stage=2",
        "logging.wandb_mode=offline"), tmp)
    run = run_job(first, out, {**USER_ENV, "RAY_ADDRESS": ""}, hostname_address=address)
    if run.returncode != 0:
        return tmp, run, ResumedRun(out, run, None, None)
    latest = (out / "latest").read_text().strip()
    policy = tmp / "first-policy.safetensors"
    shutil.copyfile(out / latest / "policy" / "model.safetensors", policy)
    resumed = ResumedRun(out, run, None, json.loads((tmp / "summary.json").read_text()), latest,
                         (out / "metrics.jsonl").read_text(), policy, list(out.glob("wandb/offline-run-*")))
    resumed.second = subprocess.run([*first, "train.num_steps=6", "train.resume=true"], cwd=ROOT,
                                    env={**USER_ENV, "RAY_ADDRESS": ""}, capture_output=True, text=True, timeout=600)
    return tmp, run, resumed


@shared_job
def http_run(tmp_path_factory, model_dir):
    """tiny_cpu_http.yaml, three steps, run once: test_http_train checks its training, test_listeners the
    sockets its processes listened on (the engines' HTTP servers, the weight broadcast group), with the
    hostname resolving to the machine's LAN address where that can be arranged."""
    from tests.local_job import SMALL, on_lan_hostname, run_job, train_command

    tmp = tmp_path_factory.mktemp("http-job")
    cmd, address = on_lan_hostname(train_command("configs/tiny_cpu_http.yaml", model_dir, tmp, *SMALL,
                                                 "engine.num_engines=2", "train.num_steps=3", "train.eval_every=2", "train.save_every=3",
                                                 "learner.backend=torch"), tmp)
    return tmp, run_job(cmd, tmp / "out", {**USER_ENV, "RAY_ADDRESS": ""}, hostname_address=address)


@shared_job
def overlap_run(tmp_path_factory, model_dir):
    """tiny_cpu.yaml with train.overlap=true, five steps and a checkpoint after the third, run once
    (tests/test_overlap_job.py reads its records)."""
    from tests.local_job import SMALL, run_job, train_command

    tmp = tmp_path_factory.mktemp("overlap-job")
    # long responses: groups finish far apart, so a kept step's N-th complete group leaves others generating
    # (at SMALL's 24 tokens nearly every sample runs to the cap, and all groups can finish in one engine step)
    cmd = train_command("configs/tiny_cpu.yaml", model_dir, tmp, *SMALL, "train.overlap=true", "train.num_steps=5",
                        "train.save_every=3", "train.eval_every=2", "logging.dashboard=false",
                        "sampling.max_response_len=200", "engine.max_model_len=256", "learner.backend=torch")
    return tmp, run_job(cmd, tmp / "out", {**USER_ENV, "RAY_ADDRESS": ""})


@shared_job(runs=2)
def watched_job(tmp_path_factory, model_dir):
    """tiny_cpu.yaml on the random tiny model, four steps submitted to a `ray start --head` that exports its
    metrics every two seconds (RAY_metrics_report_interval_ms=2000: a read a second sees each export twice,
    and a loaded machine's late refresh of a held value still lands within Ray's two intervals), each step
    paused past two export intervals by a slow reward (no over-sampling, so
    that no step is served from groups an earlier one finished), watched by its metrics endpoint and
    (installed) Prometheus, run once: test_job_submit, test_prometheus and test_plot look at it
    (tests/head_job.py)."""
    from tests.head_job import watch_job

    work = tmp_path_factory.mktemp("head-job")
    return watch_job(work, [
        f"--config configs/tiny_cpu.yaml model.path={model_dir} model.cache_dir={work}",
        "train.num_steps=4 train.eval_every=2 task.num_eval=32",
        "rollout.rollout_batch_size=4 rollout.over_sampling_batch_size=4 rollout.n_samples_per_prompt=4",
        "sampling.max_response_len=64 learner.backend=torch logging.wandb_mode=disabled logging.tensorboard=true",
        "engine.num_engines=1",
        "task.reward_fn=tests.slow_reward:countdown_after_a_pause"], export_interval_ms=2000)


@dataclass
class ResumedRun:
    out: Path
    """train.output_dir, after both jobs."""
    first: Run
    """The first job (tests/local_job.py's `Run`: its return code, output and listeners)."""
    second: subprocess.CompletedProcess | None
    """The resume; None when the first job failed."""
    summary: dict | None
    """What the first job left before the resume: its summary, latest checkpoint, metrics.jsonl, a copy
    of that checkpoint's weights, and its wandb offline runs."""
    latest: str = ""
    metrics: str = ""
    policy: Path | None = None
    wandb_runs: list = field(default_factory=list)


@pytest.fixture(scope="session")
def resumed_run(two_rank_run) -> ResumedRun:
    """The two-rank job of three steps, then its resume to six (`two_rank_run`)."""
    return two_rank_run[2]


@pytest.fixture(scope="session", autouse=True)
def prefetched(request, tmp_path_factory):
    from tests.prefetch import JOBS, Prefetch, first_asked

    prefetch = Prefetch()
    _PREFETCH.append(prefetch)
    order = first_asked(JOBS, request.session.items)
    if order:
        model_dir = request.getfixturevalue("random_model_dir")
        for name in order:
            prefetch.submit(name, functools.partial(JOBS[name], tmp_path_factory, model_dir))
    yield prefetch
    prefetch.close()

