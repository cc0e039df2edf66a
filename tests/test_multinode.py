"""Several raylets on one machine (`ray.cluster_utils.Cluster`) as a multi-node cluster, with logical GPUs."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from april_ray.placement import plan
from tests.conftest import USER_ENV
from tests.test_ray_rollout import run_steps, small_cfg, start_engines

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]

OWN_RAY = """
import json
from types import SimpleNamespace
import jobs  # as a job starts
import ray
from ray._private.services import get_ray_address_from_environment
from driver.cluster import init_ray

would = get_ray_address_from_environment(None, None)
init_ray(SimpleNamespace(bundles=[]))
print(json.dumps({"ray_would_join": would, "joined": ray.get_runtime_context().gcs_address}))
"""


def test_multi_node_cluster_spreads_engines_over_raylets(tmp_path, random_model_dir):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    nodes = [cluster.add_node(num_cpus=2, num_gpus=2) for _ in range(2)]
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        cfg = small_cfg(tmp_path, "placement.strategy=STRICT_SPREAD", "placement.engine_gpus=1",
                        "placement.engine_cpus=1")
        # two engine bundles with a logical GPU each, one learner bundle: three raylets, one bundle each
        assert plan(cfg).bundles == [{"CPU": 1.0, "GPU": 1.0}] * 2 + [{"CPU": 1.0}]
        engines = start_engines(cfg, str(random_model_dir), timeout_s=60)
        where = ray.get([e.where.remote() for e in engines.actors])
        assert len({node for node, _ in where}) == 2  # one engine per raylet
        assert {node for node, _ in where} <= {n.node_id for n in nodes}
        assert all(len(gpus) == 1 for _, gpus in where)  # each sees its own logical GPU
        run_steps(cfg, str(random_model_dir), engines, 2)
        # a job started on this machine meanwhile, RAY_ADDRESS unset, starts a Ray of its own: Ray's plain
        # `ray.init()` would join this cluster, the last one `ray start`ed here
        job = subprocess.run([sys.executable, "-c", OWN_RAY], cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env={k: v for k, v in USER_ENV.items() if k != "RAY_ADDRESS"})
        assert job.returncode == 0, job.stderr[-3000:]
        found = json.loads(job.stdout.splitlines()[-1])
        assert found["ray_would_join"] == cluster.address != found["joined"], found
    finally:
        ray.shutdown()
        cluster.shutdown()
