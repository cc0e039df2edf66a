"""Every listening socket of a local training job (Ray's GCS, raylet, workers and agents, the dashboard,
the learners' torch.distributed store, the engines' HTTP servers) is on the loopback interface, never on
0.0.0.0 or :: (all interfaces). The job is started as the README says, in the user's environment (not
the test process's); where Ray cannot bind to loopback, the local cluster requires Ray's token."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.local_job import lan_address, loopback

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("run", [
    "two_rank_run",  # tiny_cpu.yaml, two learner ranks: rank 0 hosts the rendezvous store
    "http_run",  # tiny_cpu_http.yaml: engine HTTP servers, and the weight broadcast group
])
def test_no_listener_of_a_local_job_is_on_all_interfaces(request, run):
    """Watched while it trained: the runs test_train_job and test_http_train check (conftest.py). They run
    where the hostname resolves to the machine's LAN address, as on many cloud VMs, which is where gloo's
    sockets followed the hostname off loopback; a machine with no LAN address, or no `unshare -m`, runs
    them on its own /etc/hosts."""
    job = request.getfixturevalue(run)[1]
    assert job.listeners, f"the job ended before its listeners were seen (rc {job.returncode}):\n{job.stderr[-3000:]}"
    names = {name for name, _, _ in job.listeners}
    assert {"gcs_server", "raylet", "ray::DashboardAgent"} <= names and any("Learner" in n for n in names), names
    wide = [f for f in job.listeners if not loopback(f[1])]
    assert not wide, f"listeners not on the loopback interface (hostname -> {job.hostname_address}): {wide}"
    if lan_address() is not None and os.geteuid() == 0:
        assert job.hostname_address is not None, "the job did not run on a LAN hostname, though it could have"


RAY_FIRST = """
import json, os, subprocess, sys
import ray  # before jobs: Ray has read its environment, and will listen on every interface
import psutil
from types import SimpleNamespace
from driver.cluster import init_ray
from tests.local_job import listeners, loopback

init_ray(SimpleNamespace(bundles=[]))
wide = [f for f in listeners(psutil.Process()) if not loopback(f[1])]
gcs = ray.get_runtime_context().gcs_address
# (a stranger refused tries again for RAY_gcs_server_port_wait_time_s, 20 s by default: 2 is enough to be refused)
env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"} | {"RAY_AUTH_MODE": "disabled",
                                                                         "RAY_gcs_server_port_wait_time_s": "2"}
stranger = subprocess.run([sys.executable, "-c", f"import ray; ray.init(address={gcs!r})"], env=env,
                          capture_output=True, text=True, timeout=120)
print(json.dumps({"wide": len(wide), "mode": os.environ.get("RAY_AUTH_MODE"), "stranger_rc": stranger.returncode,
                  "stranger_refused": "InvalidAuthToken" in stranger.stderr}))
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
    assert result["mode"] == "token" and result["stranger_rc"] != 0 and result["stranger_refused"], result
