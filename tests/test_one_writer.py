"""One writer per output directory, as users start jobs: two jobs started together, a resume started while a
job writes, a `run` file naming another run, a SIGKILLed job; and a user's data or model error as one line,
before Ray starts, with nothing moved."""
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from april_ray.config import TrainConfig
from driver.checkpoint import find_checkpoint
from driver.output_dir import OutputDirBusy, OutputLock, open_run
from tests.conftest import USER_ENV
from tests.local_job import ROOT, SMALL, train_command
from tests.prefetch import shared_job

FAST = [*SMALL, "train.eval_every=1000", "train.eval_greedy=false", "logging.wandb_mode=disabled",
        "logging.dashboard=false", "learner.backend=torch"]

HOLDER = """
import sys, time
from pathlib import Path
from driver.output_dir import OutputLock
lock = OutputLock(Path(sys.argv[1]), "run-of-the-holder")
print("held", flush=True)
time.sleep(600)
"""


def test_the_lock_names_its_holder_and_dies_with_it(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(OutputDirBusy, match=rf"{tmp_path}: another job writes here \(pid {holder.pid} on "
                                                rf".*, run run-of-the-holder\)"):
            OutputLock(tmp_path, "mine")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = OutputLock(tmp_path, "mine")  # the kernel dropped the dead holder's lock
    lock.release()


def files_of(path: Path) -> dict:
    """Every file under `path` with its bytes, but the lock's label and the error log (the refused job's)."""
    return {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*"))
            if p.is_file() and p.name not in (".lock", "errors.log")}


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(f"{log}.stdout", "w") as o, open(f"{log}.stderr", "w") as e:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=o, stderr=e, env={**USER_ENV, "RAY_ADDRESS": ""})


def wait_for(condition, job: subprocess.Popen, what: str, timeout_s: float = 900) -> None:
    deadline = time.time() + timeout_s
    while not condition():
        assert job.poll() is None, f"the job ended (rc {job.returncode}) before {what}"
        assert time.time() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.2)


def stderr_of(log: Path) -> str:
    return Path(f"{log}.stderr").read_text()


def latest(out: Path) -> str:
    return (out / "latest").read_text().strip() if (out / "latest").is_file() else ""


@shared_job(runs=2)
def contested(tmp_path_factory, random_model_dir):
    """Two fresh jobs started together in one output directory; once the one that got it saved a checkpoint,
    a resume there; once it saved another, it is SIGKILLed, and a resume goes on with its run for one step."""
    tmp = tmp_path_factory.mktemp("one-writer")
    out, found = tmp / "out", {}
    # far more steps than it lives for: it is still writing when the resume comes, whatever the machine's pace
    cmd = train_command("configs/tiny_cpu.yaml", random_model_dir, tmp, *FAST, "train.num_steps=100000",
                        "train.save_every=5")
    jobs = [start(cmd, tmp / "first"), start(cmd, tmp / "second")]
    try:
        deadline = time.time() + 900
        while all(j.poll() is None for j in jobs) and not latest(out) and time.time() < deadline:
            time.sleep(0.1)
        assert any(j.poll() is not None for j in jobs), "both jobs wrote to one output directory"
        loser = next(i for i, j in enumerate(jobs) if j.poll() is not None)
        winner = jobs[1 - loser]
        found["winner_ran_on"] = winner.poll() is None  # when the other was refused
        found["loser"] = (jobs[loser].returncode, stderr_of(tmp / ("first", "second")[loser]))
        found["winner_pid"] = winner.pid
        wait_for(lambda: latest(out) != "", winner, "a checkpoint")
        resume = subprocess.run([*cmd, "train.resume=true"], cwd=ROOT, capture_output=True, text=True,
                                env={**USER_ENV, "RAY_ADDRESS": ""}, timeout=600)
        found["writing_on"] = winner.poll() is None
        found["resume"] = (resume.returncode, resume.stderr)
        seen = latest(out)
        wait_for(lambda: latest(out) not in ("", seen), winner, "a checkpoint after the resume's")
    finally:
        for j in jobs:
            if j.poll() is None:
                j.send_signal(signal.SIGKILL)  # its watchdog ends its local Ray
                j.wait()
    found["run"], found["latest"] = (out / "run").read_text(), latest(out)
    last = int(found["latest"].split("-")[1])
    found["killed_with"] = {p.name: files_of(p) for p in out.glob("ckpt-*") if int(p.name.split("-")[1]) <= last}
    found["num_steps"] = last + 2  # one step more
    after = subprocess.run([*train_command("configs/tiny_cpu.yaml", random_model_dir, tmp, *FAST,
                                           f"train.num_steps={last + 2}", "train.save_every=5"), "train.resume=true"],
                           cwd=ROOT, capture_output=True, text=True, env={**USER_ENV, "RAY_ADDRESS": ""}, timeout=900)
    found["after_kill"] = after
    return out, found


@pytest.mark.slow
def test_two_jobs_started_together_one_is_refused_at_once_and_the_others_files_are_whole(contested):
    out, found = contested
    rc, stderr = found["loser"]
    assert rc == 1 and found["winner_ran_on"]
    assert stderr.strip().splitlines() == [f"error: {out}: another job writes here (pid {found['winner_pid']} on "
                                           f"{socket.gethostname()}, run {found['run']}); it holds "
                                           f"{out / '.lock'} until it ends. Wait for it, or choose another "
                                           f"train.output_dir"], stderr
    assert not (out / "runs").exists()  # nothing of the winner's moved aside
    for ckpt in out.glob("ckpt-*"):
        assert json.loads((ckpt / "manifest.json").read_text())["run"] == found["run"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # every step once, the winner's and then the resume's after the kill
    assert [r["train/version"] for r in rows if "train/version" in r] == list(range(1, found["num_steps"] + 1))


@pytest.mark.slow
def test_a_resume_started_while_a_job_writes_is_refused(contested):
    out, found = contested
    rc, stderr = found["resume"]
    assert found["writing_on"] and rc == 1
    assert f"another job writes here (pid {found['winner_pid']} on " in stderr and f"run {found['run']})" in stderr
    assert len(stderr.strip().splitlines()) == 1, stderr


@pytest.mark.slow
def test_a_sigkilled_job_leaves_no_lock_that_stops_the_next(contested):
    out, found = contested
    after = found["after_kill"]
    assert after.returncode == 0, after.stderr[-3000:]
    assert f"resumed from {out / found['latest']}" in after.stdout
    assert (out / "run").read_text() == found["run"]
    assert {name: files_of(out / name) for name in found["killed_with"]} == found["killed_with"]  # as it saved them


@pytest.mark.slow
def test_a_run_file_naming_another_run_is_refused_and_the_earlier_run_is_byte_identical(contested, random_model_dir,
                                                                                       tmp_path):
    out = tmp_path / "out"
    shutil.copytree(contested[0], out)
    (out / "run").write_text("another")
    before = files_of(out)
    proc = subprocess.run([*train_command("configs/tiny_cpu.yaml", random_model_dir, tmp_path, *FAST,
                                          "train.num_steps=6"), "train.resume=true"],
                          cwd=ROOT, capture_output=True, text=True, env={**USER_ENV, "RAY_ADDRESS": ""}, timeout=600)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and re.match(rf"error: train\.resume: another run's checkpoints are in {out}; "
                                        rf"ckpt-\d+(, ckpt-\d+)*( and \d+ more)?: belongs to run {contested[1]['run']}, not to run "
                                        rf"another that {out}/run names\. Nothing was changed", lines[0]), proc.stderr
    assert "train.start_over=true" in lines[0] and "Started a local Ray instance" not in proc.stdout + proc.stderr
    assert files_of(out) == before


BAD_ROW = '{"prompt": "1 + 2", "answer": "3"}\n{"prompt": "2 + 2"}\n'


@pytest.mark.parametrize("case", ["bad_row", "no_model"])
def test_a_data_or_model_error_is_one_line_before_ray_and_moves_nothing(case, tmp_path, random_model_dir):
    """An earlier run in the output directory stays where it is; the traceback goes to errors.log there."""
    out = tmp_path / "out"
    out.mkdir()
    open_run(out, TrainConfig(resume=False), log=lambda _: None)
    (out / "metrics.jsonl").write_text('{"step": 0, "train/version": 1}\n')
    before = files_of(out)
    data = tmp_path / "bad.jsonl"
    data.write_text(BAD_ROW)
    overrides = {"bad_row": [f"task.train_path={data}", f"task.eval_path={data}"], "no_model": []}[case]
    cmd = train_command("configs/tiny_cpu.yaml", random_model_dir, tmp_path, *FAST, *overrides)
    if case == "no_model":
        cmd = [a.replace(f"model.path={random_model_dir}", f"model.path={tmp_path}/nowhere") for a in cmd]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**USER_ENV, "RAY_ADDRESS": ""},
                          timeout=600)
    message = {"bad_row": f"{data}:2: missing field 'answer' (fields: ['prompt'])",
               "no_model": f"model.path: {tmp_path}/nowhere does not exist"}[case]
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"error: {message} (traceback in {out}/errors.log)"], proc.stderr
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr
    assert "Traceback (most recent call last)" in (out / "errors.log").read_text()
    assert files_of(out) == before and not (out / "runs").exists()
    assert find_checkpoint(out, log=None) is None


def test_a_value_error_raised_in_an_actor_is_its_one_line():
    """What the driver cannot check before Ray starts arrives wrapped by Ray, its traceback in the message:
    the job prints the error's own line; anything else is not a user's error and keeps its traceback."""
    import traceback

    import ray.exceptions as rx

    from jobs.train import users_error

    try:
        raise ValueError("/data/train.jsonl:3: prompt has characters the tokenizer does not know ('²')")
    except ValueError as e:
        failed = rx.RayTaskError("PromptSourceActor.__init__", "".join(traceback.format_exception(e)), e)
    line = "/data/train.jsonl:3: prompt has characters the tokenizer does not know ('²')"
    assert users_error(failed) == line and users_error(failed.as_instanceof_cause()) == line
    assert users_error(rx.ActorDiedError(failed)) == line  # a constructor's error, as a later call meets it
    assert users_error(rx.RayTaskError("f", "Traceback ...", KeyError("k"))) is None
    assert users_error(RuntimeError("a bug")) is None
