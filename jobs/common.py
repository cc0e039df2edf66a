"""Shared code of the entry points: config from the command line, results as JSON, the cores a job may use.
The environment is set earlier, by `jobs.env`; Ray is started by `driver.cluster`."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

# Outside a terminal (a job's log, a pipe), Hugging Face's progress bars (weight loading and saving in the
# engine and learner actors of a local Ray, which inherit this environment) would write carriage returns.
if not sys.stderr.isatty():
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from april_ray.config import Config, ConfigError, add_config_args, config_from_args  # noqa: E402
from april_ray.plugins import check_plugins  # noqa: E402


def parse(description: str, extra=None) -> tuple[Config, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=description)
    add_config_args(parser)
    if extra:
        extra(parser)
    args = parser.parse_intermixed_args()  # overrides may come before or after --flags
    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        parser.error(str(e))
    try:
        check_plugins(cfg)  # before Ray starts: a bad plug-in is one line, not an actor's traceback
    except ConfigError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    return cfg, args


def write_result(path: str | None, result: dict) -> None:
    """Print a job's result as JSON, and write it to `path` (its directory created) when given."""
    text = json.dumps(result, indent=2, default=float)
    print(text)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)


def usable_cores(cgroup: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int:
    """The cores this process may use: those it may run on (its affinity, where the system has one), fewer
    under a CPU quota (`cpu_quota`, rounded up)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # (not Linux)
        cores = os.cpu_count() or 1
    quota = cpu_quota(Path(cgroup), Path(proc_cgroup))
    return cores if quota is None else min(cores, max(1, math.ceil(quota)))


def cpu_quota(root: Path, proc_cgroup: Path) -> float | None:
    """Cores' worth of CPU time the process's cgroup allows (a container's `--cpus`, a systemd unit's
    `CPUQuota=`): the lowest quota on its path from its own cgroup up to the hierarchy's root, in cgroup v2
    (`cpu.max`) or v1's `cpu` controller (`cpu.cfs_quota_us` over `cpu.cfs_period_us`, mounted at `cpu` or
    `cpu,cpuacct`); None without one. A cgroup path the mount does not show (a container that sees only its
    own cgroup, at the root; a path outside a cgroup namespace, with `..`) is read at the root. Nothing here
    raises: what cannot be read counts as no quota."""
    try:
        entries = [line.split(":", 2) for line in proc_cgroup.read_text().splitlines() if line.count(":") >= 2]
    except (OSError, ValueError):  # (a cgroup name that is not UTF-8)
        entries = []
    v1 = [root / "cpu", root / "cpu,cpuacct"]
    places = [(root, "/", True)] + [(m, "/", False) for m in v1]
    for _, controllers, path in entries:
        if ".." in path.split("/"):
            continue
        if controllers == "":
            places.append((root, path, True))
        elif "cpu" in controllers.split(","):
            places += [(m, path, False) for m in v1]
    quotas = []
    for mount, path, v2 in places:
        d = mount / path.strip("/")
        while True:
            quotas.append(_quota_in(d, v2))
            if d == mount:
                break
            d = d.parent
    quotas = [q for q in quotas if q is not None]
    return min(quotas) if quotas else None


def _quota_in(d: Path, v2: bool) -> float | None:
    try:
        if v2:
            quota, period = (d / "cpu.max").read_text().split()[:2]
        else:
            quota, period = ((d / f).read_text().strip() for f in ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
        if quota in ("max", "-1"):
            return None
        return int(quota) / int(period)
    except (OSError, ValueError, ArithmeticError):  # none there, or not a quota
        return None
