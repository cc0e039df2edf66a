"""Ray for a job: join the cluster there is, or start a local one on loopback tied to the driver's life.

A local cluster binds to loopback when Ray was imported with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which
importing the `jobs` package sets (jobs/env.py); otherwise it gets Ray's token authentication.
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from april_ray.config import LoggingConfig


def init_ray(layout, logging: LoggingConfig | None = None, address: str | None = None) -> None:
    """Join the cluster when there is one (`ray job submit`, RAY_ADDRESS), else start a local one: a new one
    even where another is running on the machine (`ray start`, another job), which Ray's `ray.init()` would
    join unasked.

    A local cluster gets enough logical CPUs for every bundle of the job's placement group (plus one
    for the driver-side actors), even on a 2-core laptop: the processes share the cores. With `logging`
    and `logging.dashboard`, it runs Ray's dashboard on 127.0.0.1 (`logging.dashboard_port`)."""
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
        return
    need = sum(b.get("CPU", 0) for b in layout.bundles) + 1
    dashboard = logging is not None and logging.dashboard
    if not binds_to_loopback():
        require_token()
    # ray.init logs the dashboard's address ("View the dashboard at ...")
    ray.init(address="local", num_cpus=max(int(need + 0.999), os.cpu_count() or 1), include_dashboard=dashboard,
             dashboard_host="127.0.0.1", dashboard_port=(logging.dashboard_port or None) if dashboard else None,
             _node_ip_address="127.0.0.1")
    tie_to_driver()


def binds_to_loopback() -> bool:
    """Whether a cluster this process starts binds to loopback: Ray was imported with
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (`jobs.env`), so that 127.0.0.1 is taken as the node's address."""
    from ray._private import ray_constants

    return not ray_constants.ENABLE_RAY_CLUSTER


def require_token() -> None:
    """Turn on Ray's token authentication for the local cluster about to start, with a token of this job
    only, in the environment its processes inherit (nothing written to ~/.ray). For a process that imported
    Ray before `jobs`, whose cluster listens on every interface."""
    import secrets

    from ray._raylet import Config

    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    Config.initialize("")  # Ray caches its settings at import; this re-reads the mode
    print("Ray was imported before jobs (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER unset): the local cluster listens "
          "on every interface, with Ray's token authentication on", file=sys.stderr)


_watchdog = None
"""The watchdog process of this driver's local Ray; its stdin pipe closes when the driver dies."""


def tie_to_driver() -> None:
    """Start a watchdog that ends this driver's local Ray when the driver ends, however it ends.

    Ray 2.60 kills the processes `ray.init` starts (GCS, raylet, dashboard, ...) with the driver through
    PR_SET_PDEATHSIG, but not the raylet's agents: after a SIGKILLed driver, `ray::DashboardAgent` and
    `ray::RuntimeEnvAgent` noticed the raylet's death and still lived about 60 s more, trying to report
    it to the dead GCS. The watchdog (`watch_driver`, in its own session so a terminal's Ctrl-C reaches
    the driver first) records the driver's descendants while it lives and, when the pipe from the driver
    closes, terminates those still running."""
    global _watchdog
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parents[1])
    code = "import sys; from driver.cluster import watch_driver; watch_driver(int(sys.argv[1]))"
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    _watchdog = subprocess.Popen([sys.executable, "-c", code, str(os.getpid())], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
                                 env={**os.environ, "PYTHONPATH": path})
    # its first look at the driver's descendants: every process started before this returns is recorded
    _watchdog.stdout.read(1)  # b"" if it failed to start
    _watchdog.stdout.close()


def watch_driver(pid: int, poll_s: float = 0.5, grace_s: float = 3.0) -> None:
    """The watchdog's loop (see `tie_to_driver`): stdin is a pipe whose other end only the driver holds."""
    import select
    import sys

    import psutil

    seen = {}
    with contextlib.suppress(psutil.NoSuchProcess):  # the driver gone: end what it left
        driver = psutil.Process(pid)
        while True:
            seen |= {p.pid: p for p in driver.children(recursive=True) if p.pid != os.getpid()}
            if not sys.stdout.closed:  # the driver waits for this first look
                sys.stdout.write("1")
                sys.stdout.close()
            ready, _, _ = select.select([sys.stdin], [], [], poll_s)
            if ready and not os.read(sys.stdin.fileno(), 1):
                break
    alive = [p for p in seen.values() if p.is_running()]  # is_running also rules out a reused pid
    for signal in ("terminate", "kill"):
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                getattr(p, signal)()
        _, alive = psutil.wait_procs(alive, timeout=grace_s)
