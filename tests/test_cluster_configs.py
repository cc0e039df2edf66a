"""The files under cluster/: Ray cluster YAMLs through Ray's own validator, the KubeRay manifests'
structure, and the Grafana dashboard's queries against the metric names of docs/architecture.md."""
import copy
import json
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from april_ray.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_YAMLS = ["cluster/h100.yaml", "cluster/mi300x.yaml"]
GPU_KEYS = {"h100": "nvidia.com/gpu", "mi300x": "amd.com/gpu"}
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
EXPORT_INTERVAL_MS = "5000"  # what cluster/README.md says every node of the cluster files exports at

# The exported metrics (name -> kind); Prometheus shows each with Ray's `ray_` prefix.
METRICS = {
    "april_engine_occupancy": "gauge", "april_engine_bubble_fraction": "gauge",
    "april_engine_tokens_per_s": "gauge", "april_engine_weight_version": "gauge",
    "april_engine_prefill_tokens_total": "counter", "april_engine_reused_kv_tokens_total": "counter",
    "april_engine_generated_tokens_total": "counter", "april_engine_crashes_total": "counter",
    "april_abort_latency_seconds": "histogram", "april_store_partial_groups": "gauge",
    "april_store_oldest_age_versions": "gauge", "april_rollout_off_policy_token_ratio": "gauge",
    "april_trained_token_staleness_versions": "histogram", "april_step_phase_seconds": "gauge",
    "april_reward_mean": "gauge", "april_eval_accuracy": "gauge", "april_step": "gauge",
    "april_rollout_trained_tokens_total": "counter", "april_rollout_off_policy_tokens_total": "counter",
    "april_step_phase_seconds_total": "counter", "april_steps_total": "counter", "april_idle_fraction": "gauge",
    "april_mismatch_log_ratio": "gauge", "april_mismatch_kl": "gauge", "april_mismatch_correction_share": "gauge",
    "april_mismatch_tokens_total": "counter", "april_engine_leaves_total": "counter", "april_live_engines": "gauge",
}


def load(path: str):
    return yaml.safe_load((ROOT / path).read_text())


def ray_starts(cfg: dict) -> list[str]:
    cmds = cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]
    starts = [c for c in cmds if "ray start" in c]
    assert len(starts) == 2, cmds
    return starts


def flag(cmd: str, name: str) -> str | None:
    for word in shlex.split(cmd.replace(";", " ")):
        if word.startswith(f"--{name}="):
            return word.split("=", 1)[1]
    return None


def auth_mode(cmd: str) -> str:
    found = re.findall(r"RAY_AUTH_MODE=(\w+)", cmd)
    return found[-1] if found else "disabled"


# ---------------------------------------------------------------------------------- cluster YAMLs


@pytest.mark.parametrize("path", CLUSTER_YAMLS)
def test_cluster_yaml_passes_rays_validator(path):
    raw = load(path)
    validate_config(prepare_config(raw))  # what `ray up` runs before it starts anything
    broken = copy.deepcopy(raw)
    broken["setup_command"] = broken.pop("setup_commands")  # a misspelt key
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(broken))


def check_access(cfg: dict) -> None:
    """Every node with the same auth mode; a dashboard beyond loopback only with token auth, whose token
    every node gets from file_mounts."""
    starts = ray_starts(cfg)
    modes = {auth_mode(c) for c in starts}
    assert len(modes) == 1, f"RAY_AUTH_MODE differs between nodes: {starts}"
    host = flag(starts[0], "dashboard-host") or "localhost"
    if host not in LOOPBACK:
        assert modes == {"token"}, f"dashboard on {host} without token authentication"
    if modes == {"token"}:
        assert "~/.ray/auth_token" in cfg["file_mounts"], "token auth needs the token on every node"


@pytest.mark.parametrize("path", CLUSTER_YAMLS)
def test_cluster_yaml_access_metrics_and_shell(path):
    cfg = load(path)
    check_access(cfg)
    starts = ray_starts(cfg)
    ports = {flag(c, "metrics-export-port") for c in starts}
    assert len(ports) == 1 and None not in ports, f"one fixed metrics port on every node: {starts}"
    for c in starts:
        assert f"RAY_metrics_report_interval_ms={EXPORT_INTERVAL_MS} ray start" in c, c
    assert f"RAY_metrics_report_interval_ms={EXPORT_INTERVAL_MS}" in (ROOT / "cluster/README.md").read_text()
    commands = cfg["setup_commands"] + cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"]
    for cmd in commands:
        assert not re.search(r"""["']~""", cmd), f"a quoted ~ is not expanded by the shell: {cmd}"


@pytest.mark.parametrize("dashboard_host, mode, ok", [("0.0.0.0", "disabled", False), ("0.0.0.0", "token", True),
                                                      ("127.0.0.1", "disabled", True)])
def test_access_rule_rejects_an_open_dashboard(dashboard_host, mode, ok):
    cfg = copy.deepcopy(load("cluster/h100.yaml"))
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        cfg[key] = [c.replace("RAY_AUTH_MODE=token", f"RAY_AUTH_MODE={mode}")
                     .replace("--dashboard-host=127.0.0.1", f"--dashboard-host={dashboard_host}") for c in cfg[key]]
    if ok:
        check_access(cfg)
    else:
        with pytest.raises(AssertionError, match="without token"):
            check_access(cfg)


def test_mi300x_runs_sglangs_rocm_image_and_no_cuda_build():
    cfg = load("cluster/mi300x.yaml")
    assert re.fullmatch(r"lmsysorg/sglang:v[\d.]+(post\d+)?-rocm\d+-mi3\dx", cfg["docker"]["image"])
    assert {"--device=/dev/kfd", "--device=/dev/dri"} <= set(cfg["docker"]["run_options"])
    setup = " ".join(cfg["setup_commands"])
    assert "torch.version.hip" in setup, "the setup must stop if the image's torch is not a ROCm build"
    no_cuda(ROOT / "cluster/mi300x.yaml")


def no_cuda(path: Path) -> None:
    """No CUDA package, extra, index or resource outside the comments of a ROCm file."""
    text = "\n".join(line.split("#")[0] for line in path.read_text().splitlines())
    for needle in ("[sglang]", "whl/cu", "nvidia", "cuda", "-cu12", "-cu13"):
        assert needle not in text.lower(), f"{path.name}: {needle!r} in a ROCm file"


# ----------------------------------------------------------------------------- KubeRay manifests


def manifest(kind: str, gpu: str) -> dict:
    doc = load(f"cluster/kuberay/{kind.lower()}-{gpu}.yaml")
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == kind
    return doc


def containers(group: dict) -> list[dict]:
    return group["template"]["spec"]["containers"]


def check_cluster_spec(spec: dict, gpu: str) -> None:
    key = GPU_KEYS[gpu]
    head, workers = spec["headGroupSpec"], spec["workerGroupSpecs"]
    assert workers, "no worker group"
    for c in containers(head):
        assert not set(GPU_KEYS.values()) & set(c["resources"].get("limits", {})), "the head pod holds no GPU"
    for group in workers:
        (c,) = containers(group)
        for part in ("requests", "limits"):
            assert c["resources"][part][key] == 8, f"{gpu}: {key} per node"
            assert not set(GPU_KEYS.values()) - {key} & set(c["resources"][part])
        assert group["rayStartParams"]["num-gpus"] == "8"
    host = head["rayStartParams"].get("dashboard-host", "0.0.0.0")  # KubeRay's default
    assert spec.get("authOptions", {}).get("mode") == "token" or host in LOOPBACK, \
        "the head's dashboard is reachable from every pod: token authentication or loopback"
    assert head.get("serviceType", "ClusterIP") == "ClusterIP", "the head Service stays inside the cluster"
    for group in [head, *workers]:
        port = group["rayStartParams"]["metrics-export-port"]
        declared = {p["name"]: str(p["containerPort"]) for c in containers(group) for p in c.get("ports", [])}
        assert declared.get("metrics") == port, "the metrics port is declared for Prometheus"
        for c in containers(group):
            env = {e["name"]: e["value"] for e in c.get("env", [])}
            assert env.get("RAY_metrics_report_interval_ms") == EXPORT_INTERVAL_MS, c["name"]
        assert group["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == "april-ray"


@pytest.mark.parametrize("gpu", sorted(GPU_KEYS))
def test_kuberay_cluster_and_job(gpu):
    cluster, job = manifest("RayCluster", gpu), manifest("RayJob", gpu)
    check_cluster_spec(cluster["spec"], gpu)
    assert job["spec"]["rayClusterSpec"] == cluster["spec"], "the RayJob runs the RayCluster's spec"
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:4] == ["python", "-m", "jobs.train", "--config"] and len(argv) == 5, argv
    assert re.fullmatch(r"configs/qwen3_4b_\w+\.yaml", argv[4]) and (ROOT / argv[4]).is_file()
    load_config(str(ROOT / argv[4]))  # every key resolves and validates
    workdir = yaml.safe_load(job["spec"]["runtimeEnvYAML"])["working_dir"]
    assert f"WORKDIR {workdir}" in (ROOT / "cluster/kuberay/Dockerfile").read_text()
    if gpu == "mi300x":
        for path in (ROOT / "cluster/kuberay").glob("*mi300x*"):
            no_cuda(path)


def test_kuberay_check_catches_a_cuda_resource_on_mi300x():
    spec = copy.deepcopy(manifest("RayCluster", "mi300x")["spec"])
    c = containers(spec["workerGroupSpecs"][0])[0]
    for part in ("requests", "limits"):
        c["resources"][part]["nvidia.com/gpu"] = c["resources"][part].pop("amd.com/gpu")
    with pytest.raises(KeyError):
        check_cluster_spec(spec, "mi300x")


def test_podmonitor_scrapes_the_clusters_metrics_port():
    mon = load("cluster/kuberay/podmonitor.yaml")
    assert mon["kind"] == "PodMonitor"
    assert mon["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "april-ray"}
    assert [e["port"] for e in mon["spec"]["podMetricsEndpoints"]] == ["metrics"]


# ------------------------------------------------------------------------------ Grafana dashboard


def all_panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out += [p, *p.get("panels", [])]
    return out


def exprs(dashboard: dict) -> list[str]:
    found = [t["expr"] for p in all_panels(dashboard) for t in p.get("targets", [])]
    found += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return found


def metric_names(expr: str) -> set[str]:
    """The series an expression reads: every `name{` selector and every `ray_...` identifier, with a
    histogram's _bucket/_sum/_count suffix taken off."""
    assert not re.search(r"(?<![\w])april_", expr), f"a metric without Ray's ray_ prefix: {expr}"
    names = set(re.findall(r"([A-Za-z_:][\w:]*)\s*\{", expr)) | set(re.findall(r"\b(ray_\w+)", expr))
    return {series_metric(n) for n in names}


def series_metric(name: str) -> str:
    base = re.sub(r"_(bucket|sum|count)$", "", name)
    return base if METRICS.get(base.removeprefix("ray_")) == "histogram" else name


def test_grafana_dashboard_queries_only_the_exported_metrics():
    dashboard = json.loads((ROOT / "cluster/grafana/april_dashboard.json").read_text())
    used = set()
    for expr in exprs(dashboard):
        names = metric_names(expr)
        assert names, f"a query that reads no metric: {expr}"
        unknown = {n for n in names if not n.startswith("ray_") or n[4:] not in METRICS}
        assert not unknown, f"{unknown} in {expr!r} are not exported metrics"
        used |= {n[4:] for n in names}
    assert used == set(METRICS), f"no panel for {set(METRICS) - used}"


def test_grafana_dashboard_layout():
    dashboard = json.loads((ROOT / "cluster/grafana/april_dashboard.json").read_text())
    panels = [p for p in all_panels(dashboard) if p["type"] != "row"]
    assert len({p["id"] for p in all_panels(dashboard)}) == len(all_panels(dashboard))
    for p in panels:
        for t in p["targets"]:
            if re.search(r"ray_april_engine_\w+", t["expr"]):
                assert "by (engine)" in t["expr"] and "{{engine}}" in t["legendFormat"], t["expr"]
    last, mean = [p for p in panels if "ray_april_step_phase_seconds" in str(p["targets"])]
    for phase in (last, mean):
        assert "by (phase)" in phase["targets"][0]["expr"]
        assert phase["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    assert "increase(ray_april_step_phase_seconds_total" in mean["targets"][0]["expr"]
    (stale,) = [p for p in panels if "ray_april_trained_token_staleness_versions" in str(p["targets"])]
    assert stale["type"] == "heatmap" and stale["targets"][0]["format"] == "heatmap"
    assert "_bucket" in stale["targets"][0]["expr"] and "by (le)" in stale["targets"][0]["expr"]


def test_the_metrics_module_defines_exactly_these_metrics():
    from ray.util.metrics import Counter, Gauge, Histogram

    from actors.metrics import METRICS as DEFINED

    kinds = {Gauge: "gauge", Counter: "counter", Histogram: "histogram"}
    assert {name: kinds[kind] for name, (kind, _, _) in DEFINED.items()} == METRICS


def test_metric_check_rejects_an_unknown_or_unprefixed_name():
    with pytest.raises(AssertionError, match="ray_ prefix"):
        metric_names("max(april_step)")
    assert metric_names('sum by (le) (rate(ray_april_abort_latency_seconds_bucket{mode="april"}[1m]))') \
        == {"ray_april_abort_latency_seconds"}
    assert metric_names("max(ray_april_stepz)") == {"ray_april_stepz"}  # then refused: not in METRICS
