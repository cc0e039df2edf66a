"""The training job on a device: our engine placed with a GPU runs on it (and on CPU where torch has none),
fractional GPUs put a disaggregated engine and learner on one device, and `python -m jobs.gpu_check --smoke
--parts job_shape,job` runs the parts a lent GPU runs (docs/gpu.md) on CPU: the job at the 0.6B role's shape
beside the same step in process (both learner backends), then the job colocated (a first leg and a resumed
one) and overlapped."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from april_ray.config import ConfigError, EngineConfig, load_config
from april_ray.engine import build_engine, engine_device, server_options
from april_ray.engine.sglang_server import CPUServerLauncher
from april_ray.placement import actor_resources, never_fits, plan
from jobs.gpu_check.device_memory import summary, swing
from jobs.gpu_check.job import more_steps
from jobs.gpu_check.job_shape import step_split
from tests.conftest import USER_ENV
from tests.prefetch import shared_job

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cuda_usable(monkeypatch):
    """torch says a GPU is usable (for the choice alone: nothing is put on it)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CPU machine's answer")
def test_an_engine_named_a_gpu_stays_on_cpu_where_torch_has_none(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert engine_device() == "cpu"


def test_an_engine_runs_on_the_gpu_it_was_placed_with_and_on_cpu_without_one(monkeypatch, cuda_usable):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert engine_device() == "cuda"
    for unplaced in ("", " "):  # Ray names no GPU: none given to this process
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", unplaced)
        assert engine_device() == "cpu"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert engine_device() == "cpu"


def test_our_server_is_launched_on_the_engines_device(monkeypatch, cuda_usable):
    cfg = EngineConfig(backend="cpu_http", max_num_seqs=7)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    cmd = CPUServerLauncher().command(server_options(cfg, "/m", 3, 2, "/w"), port=1234)
    assert cmd[cmd.index("--device") + 1] == "cuda"
    assert cmd[cmd.index("--max-num-seqs") + 1] == "7" and cmd[cmd.index("--weight-version") + 1] == "3"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    cmd = CPUServerLauncher().command(server_options(cfg, "/m", 3, 2, "/w"), port=1234)
    assert cmd[cmd.index("--device") + 1] == "cpu"


def test_the_in_actor_engine_loads_on_cpu_when_torch_has_no_gpu(monkeypatch, random_model_dir):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    engine = build_engine(EngineConfig(max_num_seqs=2, max_model_len=32), str(random_model_dir))
    expected = "cuda" if __import__("torch").cuda.is_available() else "cpu"
    assert engine.engine.runner.device.type == expected


def test_a_disaggregated_engine_and_learner_share_one_gpu_by_halves():
    cfg = load_config(None, ["placement.engine_gpus=0.5", "learner.gpus=0.5", "engine.num_engines=1",
                             "train.overlap=true"])
    layout = plan(cfg)
    assert layout.bundles == [{"CPU": 1.0, "GPU": 0.5}, {"CPU": 1.0, "GPU": 0.5}] and not layout.colocated
    assert [actor_resources(layout, b)["num_gpus"] for b in (0, 1)] == [0.5, 0.5]
    assert never_fits(layout.bundles, "PACK", [{"CPU": 16.0, "GPU": 1.0}]) is None
    colocated = plan(load_config(None, ["placement.colocate=true", "placement.engine_gpus=1", "learner.gpus=1",
                                        "engine.num_engines=1"]))
    assert colocated.bundles == [{"CPU": 1.0, "GPU": 1.0}] and colocated.colocated
    assert actor_resources(colocated, 0)["num_gpus"] == 0.5  # the engine and the rank, half each


@pytest.mark.parametrize("key", ["placement.engine_gpus", "learner.gpus"])
@pytest.mark.parametrize("value", ["1.5", "2.0", "-1"])
def test_more_than_one_gpu_is_a_whole_number(key, value):
    with pytest.raises(ConfigError, match=f"{key}: must be an integer >= 0, or a fraction in"):
        load_config(None, [f"{key}={value}"])


def test_the_resumed_leg_takes_the_steps_the_rest_of_the_budget_holds():
    first = {"steps": 20, "train_s": 20.0, "process_wall_s": 60.0}  # 1 s a step, 40 s outside training
    assert more_steps(first, left_s=100.0, max_steps=200) == 40  # (100 - 1.25 x 40) / 1.25
    assert more_steps(first, left_s=1000.0, max_steps=200) == 180  # no more than the run's steps
    assert more_steps(first, left_s=40.0, max_steps=200) == 0


def test_the_device_memory_summary_counts_the_engines_releases():
    # starting (14 MiB, then the CUDA context), then two releases of its 170 MiB of KV cache and weights, then noise
    used = [14, 600, 1100, 930, 1110, 930, 1110, 1106, 1110]
    samples = [(i * 0.1, 2000 + u, {"engine_server": u, "learner": 1000}) for i, u in enumerate(used)]
    samples.append((0.9, 3000, {"learner": 1000}))  # the server gone: not a release
    s = summary(samples, 0.1)
    assert s["by_role_mib"]["engine_server"] == {"max": 1110, "min": 930, "start_min": 14, "released": 180,
                                                 "drops": 2}
    assert s["by_role_mib"]["learner"]["drops"] == 0 and s["samples"] == 10
    assert s["engine_server_changes"][:3] == [[0.0, 14], [0.1, 600], [0.2, 1100]]
    assert [0.7, 1106] in s["engine_server_changes"]
    assert summary([], 0.1, "NVML: no GPU") == {"source": None, "why": "NVML: no GPU"}
    assert swing([500, 1000, 997, 1000, 996])["drops"] == 0  # a few MiB is the allocator, not a release


FRACTIONS = textwrap.dedent("""
    import os, sys
    import jobs  # as a job starts
    import ray
    from april_ray.config import load_config
    from april_ray.placement import actor_resources, plan
    from driver.placement import place
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote
    def where():
        from april_ray.engine import engine_device
        return os.environ.get("CUDA_VISIBLE_DEVICES"), engine_device()

    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False)  # never another test's Ray
    layout = plan(load_config(None, ["placement.engine_gpus=0.5", "learner.gpus=0.5", "engine.num_engines=1"]))
    pg = place(layout, 120)
    print(ray.get([where.options(**actor_resources(layout, b), scheduling_strategy=PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=b)).remote() for b in (0, 1)]))
""")


@pytest.mark.slow
def test_half_gpu_bundles_land_on_the_one_gpu_and_a_cpu_torch_stays_on_cpu():
    """On a Ray node of one (logical) GPU both bundles of half a GPU are placed, each task sees that GPU, and
    an engine there stays on CPU where torch has no CUDA."""
    proc = subprocess.run([sys.executable, "-c", FRACTIONS], cwd=ROOT, env={**USER_ENV, "RAY_ADDRESS": ""},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = "cuda" if __import__("torch").cuda.is_available() else "cpu"
    assert proc.stdout.strip().splitlines()[-1] == repr([("0", expected), ("0", expected)])


@pytest.mark.gpu
def test_the_in_actor_engine_generates_on_the_gpu_it_is_placed_with(monkeypatch, random_model_dir):
    import asyncio

    from april_ray.types import GenerateRequest, SamplingParams

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES") or "0")  # as Ray sets it
    engine = build_engine(EngineConfig(max_num_seqs=2, max_model_len=32), str(random_model_dir))
    assert engine.engine.runner.device.type == "cuda"
    out = asyncio.run(engine.generate(GenerateRequest("r0", [1, 2, 3], SamplingParams(0.0, 1.0, -1, 5, ()))))
    assert len(out.token_ids) == 5


@shared_job(runs=4)
def gpu_job_smoke(tmp_path_factory, model_dir):
    tmp = tmp_path_factory.mktemp("gpu_job")
    out = tmp / "check.json"
    # a budget no run reaches on a loaded CPU: the colocated run takes its resumed step; the smoke's model (no
    # warm-up) is built in this test's own cache
    proc = subprocess.run([sys.executable, "-m", "jobs.gpu_check", "--smoke", "--parts", "job_shape,job", "--budget-s",
                           "6000",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=3600,
                          env={**USER_ENV, "RAY_ADDRESS": "", "APRIL_RAY_CACHE": str(tmp / "cache")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.slow
def test_the_job_part_trains_colocated_then_resumed_and_overlapped_without_losing_a_sample(gpu_job_smoke):
    result, stdout = gpu_job_smoke
    assert list(result) == ["device", "job_shape", "job"] and "error" not in result["job"], result["job"]
    colocated, overlapped = result["job"]["colocated"], result["job"]["overlapped"]
    for run, steps in ((colocated, 2), (overlapped, 2)):
        assert run["exit"] == 0 and "error" not in run, run.get("error")
        assert run["steps"] == steps and run["steps_per_s"] > 0 and run["generated_tokens_per_s"] > 0
        assert 0 <= run["accuracy_before"] <= 1 and 0 <= run["accuracy_after"] <= 1
        rec = run["records"]
        assert rec["lost_samples"] == 0 and rec["duplicated_samples"] == 0 and rec["complete_record"]
        assert rec["steps_completed"] == steps
    assert [leg["steps"] for leg in colocated["legs"]] == [1, 1]  # the second resumed from the first's checkpoint
    assert "train.resume=true" not in colocated["overrides"] and "engine.weight_sync=tensor" in colocated["overrides"]
    assert "train.overlap=true" in overlapped["overrides"]
    assert colocated["device_memory"]["source"] is None and colocated["device_memory"]["why"]  # no GPU here
    assert "job colocated: exit 0, 2 steps" in stdout and "job overlapped: exit 0, 2 steps" in stdout


def test_the_step_split_takes_the_rest_as_the_wall_less_its_phases_and_leaves_evaluation_out():
    rows = [{"time/wall_s": 10.0, "time/rollout_s": 6.0, "time/learner_s": 2.0, "time/weight_sync_s": 1.0},
            {"time/wall_s": 14.0, "time/rollout_s": 2.0, "time/learner_s": 1.0, "time/weight_sync_s": 0.5},
            {"time/wall_s": 20.0, "time/rollout_s": 2.0, "time/learner_s": 1.0, "time/weight_sync_s": 0.5,
             "time/eval_s": 1.5}]
    split = step_split(rows)
    assert split["first"] == {"rollout": 6.0, "learner": 2.0, "weight_sync": 1.0, "rest": 1.0, "step": 10.0}
    assert [s["rest"] for s in split["per_step"]] == [1.0, 0.5, 1.0]
    assert split["median"] == {"rollout": 2.0, "learner": 1.0, "weight_sync": 0.5, "rest": 0.75, "step": 4.25}


@pytest.mark.slow
def test_the_job_at_the_shape_splits_its_steps_beside_the_same_step_in_process(gpu_job_smoke):
    """A random model over more ids than the tokenizer has: the reward never fires, and the job and both
    learner backends still take every step."""
    res = gpu_job_smoke[0]["job_shape"]
    job, proc = res["job"], res["in_process"]
    assert job["exit"] == 0 and "error" not in job, job.get("error")
    assert job["steps"] == 2 and job["records"]["lost_samples"] == 0 and job["records"]["duplicated_samples"] == 0
    assert "rollout.schedule=sync" in job["overrides"] and any(o.startswith("model.path=") for o in job["overrides"])
    assert len(job["split"]["per_step"]) == 2 and job["split"]["median"]["step"] > 0
    rows = res["setting"]["rows"]
    assert proc["rollout"]["step_s"] > 0 and proc["rollout"]["reward_mean"] == 0
    assert proc["rollout"]["prompt_tokens"] + proc["rollout"]["response_tokens"] > rows
    for backend, stage in (("torch", 0), ("deepspeed", 1)):
        step = proc["learner"][backend]
        assert step["backend"] == backend and step["zero_stage"] == stage and step["step_s"] > 0, step
        assert step["tokens"] == proc["rollout"]["prompt_tokens"] + proc["rollout"]["response_tokens"]
        assert step["grad_norm"] == 0  # equal rewards: zero advantages, a full step all the same
    assert res["simulated"]["rollout"] > 0 and res["simulated"]["learner"] > 0
    cost = res["ray_cost"]
    assert cost["seconds_per_step"] == pytest.approx(job["split"]["median"]["step"] - cost["in_process_step_s"])
    assert "job_shape (Qwen3-0.6B" in gpu_job_smoke[1] and "Ray and the actors:" in gpu_job_smoke[1]
