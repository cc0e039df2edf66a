"""Every listening socket of a local training job (Ray's GCS, raylet, workers and agents, the dashboard,
the learners' torch.distributed store, the engines' HTTP servers) is on the loopback interface, never on
0.0.0.0 or :: (all interfaces). The job is started as the README says, in the user's environment (not
the test process's); where Ray cannot bind to loopback, the local cluster requires Ray's token."""
import ipaddress
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def listeners(root: psutil.Process) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket of `root` and its descendants."""
    out = []
    for p in [root, *root.children(recursive=True)]:
        try:
            name, conns = p.name(), p.net_connections(kind="inet")
        except psutil.Error:
            continue
        out += [(name, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return (mapped or ip).is_loopback


def trained_steps(metrics: Path) -> int:
    if not metrics.is_file():
        return 0
    rows = []
    for line in metrics.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return sum("train/version" in r for r in rows)


@pytest.mark.parametrize("config,extra", [
    ("configs/tiny_cpu.yaml", ["learner.num_ranks=2"]),  # two ranks: rank 0 hosts the rendezvous store
    ("configs/tiny_cpu_http.yaml", []),  # engine HTTP servers, and the weight broadcast group
])
def test_no_listener_of_a_local_job_is_on_all_interfaces(tmp_path, random_model_dir, user_env, config, extra):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "jobs.train", "--config", config, f"model.path={random_model_dir}",
           f"model.cache_dir={tmp_path}", f"train.output_dir={out}", "task.num_train=300", "task.num_eval=16",
           "rollout.rollout_batch_size=4", "rollout.over_sampling_batch_size=8", "rollout.n_samples_per_prompt=4",
           "sampling.max_response_len=24", "engine.max_model_len=64", "train.num_steps=200", "train.eval_every=1000",
           "train.save_every=1000", "logging.wandb_mode=disabled", "logging.dashboard=true", *extra]
    log = open(tmp_path / "job.log", "w")
    job = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=user_env)
    try:
        deadline = time.time() + 600
        while trained_steps(out / "metrics.jsonl") < 2:  # learners set up, weights published, a step done
            assert job.poll() is None, (tmp_path / "job.log").read_text()[-3000:]
            assert time.time() < deadline, "no training step within 600 s"
            time.sleep(1)
        found = listeners(psutil.Process(job.pid))
    finally:
        under = psutil.Process(job.pid).children(recursive=True) if job.poll() is None else []
        job.send_signal(signal.SIGKILL)
        job.wait()
        log.close()
        _, alive = psutil.wait_procs(under, timeout=30)  # the job's watchdog ends its local Ray
        for p in alive:
            p.kill()
    names = {name for name, _, _ in found}
    assert {"gcs_server", "raylet", "ray::DashboardAgent"} <= names and any("Learner" in n for n in names), names
    wide = [f for f in found if not loopback(f[1])]
    assert not wide, f"listeners not on the loopback interface: {wide}"


RAY_FIRST = """
import json, os, subprocess, sys
import ray  # before jobs: Ray has read its environment, and will listen on every interface
import psutil
from types import SimpleNamespace
from driver.cluster import init_ray
from tests.test_listeners import listeners, loopback

init_ray(SimpleNamespace(bundles=[]))
wide = [f for f in listeners(psutil.Process()) if not loopback(f[1])]
gcs = ray.get_runtime_context().gcs_address
env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"} | {"RAY_AUTH_MODE": "disabled"}
stranger = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address={gcs!r})"], env=env,
                          capture_output=True, text=True, timeout=120)
print(json.dumps({"wide": len(wide), "mode": os.environ.get("RAY_AUTH_MODE"), "stranger_rc": stranger.returncode}))
"""


def test_a_local_cluster_that_cannot_bind_to_loopback_requires_a_token(tmp_path, user_env):
    """A process that imports Ray before `jobs` (a notebook, a script of the user's) gets a cluster that
    listens on every interface: `init_ray` turns Ray's token authentication on, and a client without the
    job's token is refused."""
    proc = subprocess.run([sys.executable, "-c", RAY_FIRST], cwd=ROOT, env=user_env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["wide"] > 0, "Ray bound to loopback after all: this test no longer covers the fallback"
    assert result["mode"] == "token" and result["stranger_rc"] != 0, result
