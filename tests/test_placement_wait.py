"""A placement group the cluster cannot hold: the sure cases found without Ray (`never_fits`), an autoscaler
told from the nodes a cluster config names, and on a `ray start --head --num-cpus=2` the default job failing at
once with the bundles and the free resources, and a placement that waits saying so until it gives up."""
import subprocess
import sys
from pathlib import Path

import pytest

from april_ray.placement import never_fits, spread
from driver.placement import from_config, report_node_types
from tests.conftest import USER_ENV
from tests.local_job import train_command

ROOT = Path(__file__).resolve().parents[1]
CPU = {"CPU": 1.0}


def test_a_placement_that_fits_an_empty_cluster_is_never_turned_away():
    two_cpus = [{"CPU": 2.0, "memory": 1e9}]
    assert never_fits([CPU, CPU], "PACK", two_cpus) is None
    assert never_fits([CPU, CPU], "STRICT_PACK", two_cpus) is None
    # the nodes are busy or not: only their totals count
    assert never_fits([{"CPU": 1.0, "GPU": 1.0}] * 2, "SPREAD", [{"CPU": 4.0, "GPU": 1.0}] * 2) is None
    # the smaller node for the smaller bundle: a first fit in this order would find no node for the second
    assert never_fits([{"CPU": 1.0}, {"CPU": 2.0}], "STRICT_SPREAD", [{"CPU": 2.0}, {"CPU": 1.0}]) is None
    assert spread([{"CPU": 1.0}, {"CPU": 2.0}], [{"CPU": 2.0}, {"CPU": 1.0}]) == 2


def test_a_placement_no_cluster_of_these_nodes_can_hold_says_why():
    assert never_fits([CPU] * 3, "PACK", [{"CPU": 2.0}]) == \
        "they ask for {'CPU': 3.0} in all and the cluster has {'CPU': 2.0}"
    assert never_fits([{"CPU": 3.0}], "PACK", [{"CPU": 2.0}] * 2) == "no node has the {'CPU': 3.0} of one bundle"
    assert "STRICT_PACK puts all of {'CPU': 3.0} on one node" in never_fits([CPU] * 3, "STRICT_PACK", [{"CPU": 2}] * 2)
    assert "at most 2 nodes can take one each" in never_fits([CPU] * 3, "STRICT_SPREAD", [{"CPU": 4.0}] * 2)
    assert never_fits([{"CPU": 1.0, "GPU": 1.0}] * 2, "PACK", [{"CPU": 8.0}]) == "the cluster has no GPU"


def test_an_autoscaler_is_told_by_the_node_types_of_a_cluster_config():
    """The status Ray 2.60's autoscaler wrote on a `ray start --head` (it mirrors the one node, launches none)
    and on a head started with `--autoscaling-config` (fake_multinode provider) while it launched a worker."""
    mirrored = {"autoscaler_report": {
        "active_nodes": {"node_26d5db5eedbc4630e6f3eef002a6ced9cc63b368c2c76ce1d446eac5": 1}, "idle_nodes": None,
        "pending_nodes": [], "pending_launches": {}, "failed_nodes": [], "legacy": True}}
    configured = {"autoscaler_report": {
        "active_nodes": {"ray.head.default": 1}, "idle_nodes": None, "pending_launches": {"ray.worker.cpu": 1},
        "pending_nodes": [["127.0.0.1", "ray.worker.cpu", "setting-up"]], "failed_nodes": [], "legacy": True}}
    assert from_config(report_node_types(mirrored)) == []
    assert from_config(report_node_types(configured)) == ["ray.head.default", "ray.worker.cpu"]
    assert from_config(report_node_types({"load_metrics_report": {}})) == []  # no report yet: no autoscaler seen


WAITS = """
import sys
import jobs  # as a job starts
import ray
from april_ray.placement import Layout
from driver.placement import PlacementError, place


@ray.remote(num_cpus=1)
class Holder:  # keeps one of the two CPUs while it lives
    def ready(self):
        return True


ray.init(address=sys.argv[1], log_to_driver=False)
held = Holder.remote()
ray.get(held.ready.remote())
layout = Layout([{"CPU": 1.0}] * 2, "PACK", [0], [1], 1.0)
try:
    place(layout, timeout_s=6, remind_s=1)
except PlacementError as e:
    print(f"error: {e}", flush=True)
ray.kill(held)
place(layout, timeout_s=120)  # the placement group that was given up holds nothing
print("placed once the CPU was free", flush=True)
"""


@pytest.fixture(scope="module")
def two_cpu_head(tmp_path_factory):
    """`ray start --head --num-cpus=2` on loopback, its own temp dir and ports (`jobs.dashboard_screenshot`)."""
    from jobs.dashboard_screenshot import local_head

    with local_head(tmp_path_factory.mktemp("head") / "head.log", num_cpus=2) as head:
        yield head["gcs"]


def joining(address: str) -> dict:
    """A job's environment joining the head on loopback (without the flag Ray takes 127.0.0.1 for the machine's
    own address, where the head does not listen)."""
    return {**USER_ENV, "RAY_ADDRESS": address, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@pytest.mark.slow
def test_the_default_job_on_a_two_cpu_head_fails_at_once_naming_bundles_and_free_resources(
        two_cpu_head, tmp_path, random_model_dir):
    """tiny_cpu.yaml asks for three one-CPU bundles; a head of two CPUs with no autoscaler can never hold them.
    The job must end long before the 300 s it once waited (the timeout), with one line and no traceback."""
    cmd = train_command("configs/tiny_cpu.yaml", random_model_dir, tmp_path, "task.num_train=300", "task.num_eval=16",
                        "logging.wandb_mode=disabled")
    proc = subprocess.run(cmd, cwd=ROOT, env=joining(two_cpu_head), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the placement group asks for {'CPU': 3.0} in 3 bundles [{'CPU': 1.0}, "
                           "{'CPU': 1.0}, {'CPU': 1.0}] (PACK); the cluster has {'CPU': 2.0} free of {'CPU': 2.0}: "
                           "it can never hold them"), last
    assert "no autoscaler can add nodes" in last and "engine.num_engines" in last
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout


@pytest.mark.slow
def test_a_placement_held_up_by_busy_resources_says_so_then_gives_up(two_cpu_head):
    proc = subprocess.run([sys.executable, "-c", WAITS, two_cpu_head], cwd=ROOT, env=joining(two_cpu_head),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    asked = "the placement group asks for {'CPU': 2.0} in 2 bundles [{'CPU': 1.0}, {'CPU': 1.0}] (PACK)"
    assert lines[0] == f"{asked}; the cluster has {{'CPU': 1.0}} free of {{'CPU': 2.0}}; waiting up to 6s: " \
                       "resources in use may come free", lines
    assert [line for line in lines if line.startswith("still waiting after ") and asked in line], lines
    assert [line for line in lines if line.startswith(f"error: could not be placed within 6s: {asked}")], lines
    assert lines[-1] == "placed once the CPU was free"
