"""A training job watched as an operator watches one: a head started with `ray start --head`
(`jobs.dashboard_screenshot.local_head`), Debian's `prometheus` on loopback scraping it every second through
Ray's file-based service discovery (when installed), the job submitted with the repository as working_dir,
and the node's metrics endpoint read every second while it runs. What the tests look at is collected
before the head and Prometheus stop: the endpoint's `ray_april_*` lines at each read, and from Prometheus
every query of the Grafana dashboard over the job's window and the raw samples of a few series."""
from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from jobs.dashboard_screenshot import ROOT, free_ports, get, local_head, submit

SCRAPE_S = 1
RATE_INTERVAL = f"{4 * SCRAPE_S}s"  # Grafana's $__rate_interval at a 1 s query step: 4 scrape intervals
RAW = ("up", "ray_april_eval_accuracy", "ray_april_step", "ray_april_steps_total", "ray_april_step_phase_seconds",
       "ray_april_step_phase_seconds_total", "ray_april_engine_crashes_total")
"""Series whose every sample in the job's window is kept."""


@dataclass
class Watched:
    status: str
    logs: str
    out: Path
    """The job's train.output_dir."""
    summary: dict | None
    reads: list[tuple[float, list[str]]]
    """(time, the endpoint's `ray_april_*` lines) at each read, about one a second."""
    last_row_t: float
    """When the job wrote its last row of metrics.jsonl (the job still runs then)."""
    panels: dict | None = None
    """(panel title, refId) -> Prometheus's query_range result over the job's window; None without Prometheus."""
    raw: dict | None = None
    """Series of `RAW` -> [(labels, [(time, value), ...])] over the job's window."""


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


@contextlib.contextmanager
def prometheus(sd_file: Path, work: Path):
    """Prometheus on a free loopback port with its own data directory, scraping the targets Ray writes to
    `sd_file` every second; yields its base URL."""
    (port,) = free_ports(1)
    config = work / "prometheus.yml"
    config.write_text(f"""global:
  scrape_interval: {SCRAPE_S}s
  scrape_timeout: {SCRAPE_S}s
  evaluation_interval: {SCRAPE_S}s
scrape_configs:
  - job_name: ray
    file_sd_configs:
      - files: ['{sd_file}']
        refresh_interval: 1s
""")
    cmd = [prometheus_binary(), f"--config.file={config}", f"--storage.tsdb.path={work / 'data'}",
           f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"]
    with open(work / "prometheus.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, (work / "prometheus.log").read_text()[-3000:]
            try:
                get(f"{url}/-/ready")
                break
            except OSError:
                assert time.time() < deadline, "prometheus not ready within 120 s"
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def promql(url: str, path: str, **params) -> dict:
    body = json.loads(get(f"{url}/api/v1/{path}?{urllib.parse.urlencode(params)}", timeout=30))
    assert body["status"] == "success", body
    return body["data"]


def dashboard_queries() -> dict[tuple[str, str], str]:
    """(panel title, refId) -> every panel query of the Grafana dashboard, its variables filled in as Grafana
    does for all sessions and engines at a 1 s step."""
    dashboard = json.loads((ROOT / "cluster/grafana/april_dashboard.json").read_text())
    panels = [q for p in dashboard["panels"] for q in [p, *p.get("panels", [])]]
    return {(p["title"], t["refId"]): t["expr"].replace("$SessionName", ".+").replace("$engine", ".+")
            .replace("$__rate_interval", RATE_INTERVAL) for p in panels for t in p.get("targets", [])}


def collect(url: str, start: float, end: float) -> tuple[dict, dict]:
    panels = {key: promql(url, "query_range", query=expr, start=start, end=end, step=SCRAPE_S)["result"]
              for key, expr in dashboard_queries().items()}
    raw = {}
    for name in RAW:
        result = promql(url, "query", query=f"{name}[{int(end - start) + 1}s]", time=end)["result"]
        raw[name] = [(r["metric"], [(float(t), float(v)) for t, v in r["values"]]) for r in result]
    return panels, raw


def april_lines(port: int) -> list[str] | None:
    try:
        text = get(f"http://127.0.0.1:{port}/metrics")
    except OSError:  # a read that timed out on a loaded machine: no read
        return None
    return [line for line in text.splitlines() if line.startswith("ray_april_")]


def watch_job(work: Path, overrides: list[str], export_interval_ms: int = 1000, with_prometheus: bool = True,
              timeout_s: float = 900) -> Watched:
    """`python -m jobs.train` with `overrides` on a fresh head, watched to its end."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    out, summary_path = work / "out", work / "summary.json"
    entrypoint = " ".join(["python -m jobs.train", *overrides, f"train.output_dir={out}", f"--summary {summary_path}"])
    with contextlib.ExitStack() as stack:
        head = stack.enter_context(local_head(work / "ray_start.log", export_interval_ms=export_interval_ms))
        url = None
        if with_prometheus and prometheus_binary():
            (work / "prometheus").mkdir()
            sd_file = Path(head["temp_dir"]) / "prom_metrics_service_discovery.json"
            url = stack.enter_context(prometheus(sd_file, work / "prometheus"))
        client = JobSubmissionClient(f"http://127.0.0.1:{head['dashboard']}")
        start = time.time()
        job = submit(client, entrypoint, wait_s=600)  # a loaded machine registers the agent late
        reads, deadline = [], time.time() + timeout_s
        while (status := client.get_job_status(job)) not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
            assert time.time() < deadline, f"job still {status}:\n{client.get_job_logs(job)[-3000:]}"
            if (lines := april_lines(head["metrics"])) is not None:
                reads.append((time.time(), lines))
            time.sleep(1)
        logs = client.get_job_logs(job)
        metrics = out / "metrics.jsonl"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
        watched = Watched(str(status), logs, out, summary, reads,
                          metrics.stat().st_mtime if metrics.is_file() else time.time())
        if url is not None:
            time.sleep(2 * SCRAPE_S)  # the last scrapes of the job's window
            watched.panels, watched.raw = collect(url, start, time.time())
    shutil.rmtree(work / "prometheus", ignore_errors=True)  # its data: no test reads it
    return watched
