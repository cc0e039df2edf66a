"""A picture of a training run in Ray's dashboard: a local head as `ray start --head` makes it (127.0.0.1,
free ports, its own temp dir), a short `jobs.train` run submitted to it with the repository as
working_dir, and the dashboard's job page captured mid-run in headless Chromium, with its overview
page beside it.

    python -m jobs.dashboard_screenshot [--out docs/dashboard.png] [--steps 10] [--after-steps 5]

Needs `chromium` (Debian: `apt-get install chromium`) and Pillow (with matplotlib); not part of CI.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXCLUDES = [".venv", "outputs", ".git", ".pytest_cache", "*.egg-info", "__pycache__", "docs/*.png"]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars"]


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def get(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


STARTUP_TIMED_OUT = ("timed out during startup", "Failed to read dashboard.err file")
"""What `ray start` says when its node did not come up in Ray's fixed 30 s, or its dashboard did not register
within RAY_DASHBOARD_STARTUP_TIMEOUT_S and had written nothing yet (a loaded machine): worth a new try."""
DASHBOARD_STARTUP_S = 180
"""How long `ray start` waits for its dashboard to register (Ray's default, 60 s, is missed at load 19)."""


@contextlib.contextmanager
def local_head(log_path: Path, num_cpus: int = 8, up_s: float = 240, export_interval_ms: int = 1000,
               tries: int = 3):
    """`ray start --head --block` on 127.0.0.1 with free ports and its own temp dir, so no other
    `ray.init()` on the machine finds it; yields {"dashboard": port, "metrics": port, "temp_dir": path,
    "gcs": its address} once the node is up ("Ray runtime started.") and the dashboard answers
    (its nodes export their metrics every `export_interval_ms`). A start whose node or dashboard timed out
    (`STARTUP_TIMED_OUT`) is tried again, up to `tries` times. Leaving stops the
    command, and Ray's reaper stops what it started: never `ray stop`, which ends every Ray here."""
    for attempt in range(1, tries + 1):
        gcs, dashboard, metrics, agent, client = free_ports(5)
        temp_dir = tempfile.mkdtemp(prefix="rayjs", dir="/tmp")  # short: Ray's socket paths have a length limit
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
               "RAY_USAGE_STATS_ENABLED": "0", "RAY_metrics_report_interval_ms": str(export_interval_ms),
               "RAY_DASHBOARD_STARTUP_TIMEOUT_S": str(DASHBOARD_STARTUP_S),
               "PYTHONUNBUFFERED": "1",  # its "Ray runtime started." reaches the log as it is said
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        env.pop("RAY_ADDRESS", None)
        cmd = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
               f"--port={gcs}", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
               f"--dashboard-port={dashboard}", f"--metrics-export-port={metrics}",
               f"--dashboard-agent-listen-port={agent}", f"--ray-client-server-port={client}",
               f"--temp-dir={temp_dir}", f"--num-cpus={num_cpus}"]
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                up = wait_up(proc, log_path, dashboard, up_s, retry=attempt < tries)
                if up:
                    yield {"dashboard": dashboard, "metrics": metrics, "temp_dir": temp_dir,
                           "gcs": f"127.0.0.1:{gcs}"}
                    return
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)  # the process group of the command started here
                shutil.rmtree(temp_dir, ignore_errors=True)
        print(f"ray start: the node timed out during startup (try {attempt} of {tries}); starting it again",
              file=sys.stderr)


def wait_up(proc, log_path: Path, dashboard: int, up_s: float, retry: bool) -> bool:
    """Whether `ray start` brought its node up and its dashboard answers within `up_s`; False when the node
    timed out during startup and `retry`; any other exit, or the deadline, raises with the log's end."""
    deadline = time.time() + up_s
    while True:
        if proc.poll() is not None:
            text = log_path.read_text()
            if retry and any(why in text for why in STARTUP_TIMED_OUT):
                return False
            raise RuntimeError(f"ray start exited:\n{text[-3000:]}")
        if "Ray runtime started." in log_path.read_text():
            try:
                get(f"http://127.0.0.1:{dashboard}/api/version")
                return True
            except OSError:
                pass
        if time.time() > deadline:
            raise RuntimeError(f"the head did not come up within {up_s:.0f}s:\n{log_path.read_text()[-3000:]}")
        time.sleep(1)


def submit(client, entrypoint: str, wait_s: float = 180) -> str:
    """Submit `entrypoint` with the repository as working_dir, retrying for up to `wait_s` while the head
    cannot take it yet: its dashboard answers before its node's agent has registered (Ray refuses the job,
    "No available agent ... try again later"), and a loaded head drops connections mid-request
    (`requests.ConnectionError`). Every try carries the same submission_id, so a retry of a POST that the
    head accepted before the connection dropped is refused as "already exists" and counts as submitted,
    never as a second job."""
    import requests

    submission_id = f"april_{uuid.uuid4().hex[:16]}"
    deadline = time.time() + wait_s
    while True:
        try:
            return client.submit_job(entrypoint=entrypoint, submission_id=submission_id,
                                     runtime_env={"working_dir": str(ROOT), "excludes": EXCLUDES})
        except RuntimeError as e:
            if f"{submission_id} already exists" in str(e):
                return submission_id
            if "No available agent" not in str(e):
                raise
            error = e
        except requests.ConnectionError as e:
            error = e
        if time.time() > deadline:
            raise RuntimeError(f"the head did not take job {submission_id} within {wait_s:.0f}s; "
                               f"last error: {type(error).__name__}: {error}") from error
        time.sleep(2)


def screenshot(url: str, out: Path, size: tuple[int, int], wait_ms: int = 8000) -> None:
    """One page in headless Chromium, after `wait_ms` of its virtual time (the dashboard fetches its data)."""
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(["chromium", *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}",
                        f"--virtual-time-budget={wait_ms}", f"--screenshot={out}", url],
                       check=True, capture_output=True, timeout=180)


def side_by_side(left: Path, right: Path, out: Path) -> None:
    from PIL import Image

    a, b = Image.open(left), Image.open(right)
    canvas = Image.new("RGB", (a.width + b.width + 16, max(a.height, b.height)), "white")
    canvas.paste(a, (0, 0))
    canvas.paste(b, (a.width + 16, 0))
    canvas.save(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="docs/dashboard.png")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--after-steps", type=int, default=5, help="take the pictures once this many steps ran")
    args = parser.parse_args()
    from ray.job_submission import JobStatus, JobSubmissionClient

    work = Path(tempfile.mkdtemp(prefix="april-dash"))
    entrypoint = (f"python -m jobs.train --config configs/tiny_cpu.yaml train.num_steps={args.steps} "
                  "train.eval_every=4 task.num_eval=64 logging.wandb_mode=disabled "
                  f"train.output_dir={work}/out --summary {work}/summary.json")
    with local_head(work / "ray_start.log") as ports:
        base = f"http://127.0.0.1:{ports['dashboard']}"
        client = JobSubmissionClient(base)
        job = submit(client, entrypoint)
        print(f"submitted {job}; dashboard {base}", flush=True)
        while f"step {args.after_steps}/" not in client.get_job_logs(job):
            if client.get_job_status(job) in {JobStatus.FAILED, JobStatus.STOPPED}:
                raise RuntimeError(client.get_job_logs(job)[-3000:])
            time.sleep(2)
        screenshot(f"{base}/#/jobs/{job}", work / "job.png", (1280, 1400))
        screenshot(f"{base}/#/overview", work / "overview.png", (1280, 1400))
        side_by_side(work / "job.png", work / "overview.png", ROOT / args.out)
        print(f"wrote {args.out}; the job goes on to the end", flush=True)
        while client.get_job_status(job) not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
            time.sleep(2)
        print(client.get_job_logs(job)[-1500:])
        print(f"job {client.get_job_status(job)}")


if __name__ == "__main__":
    main()
