"""Shared start-up for jobs: environment defaults, config from the command line, the policy directory."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

# Every Ray listener on 127.0.0.1 (Ray otherwise takes the machine's address), no usage stats, and one
# auth mode everywhere (a local ray.init turns token auth on, which `ray job submit` then lacks).
for key, value in {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
                   "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(key, value)

from april_ray.config import Config, ConfigError, LoggingConfig, add_config_args, config_from_args  # noqa: E402


def parse(description: str, extra=None) -> tuple[Config, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=description)
    add_config_args(parser)
    if extra:
        extra(parser)
    args = parser.parse_intermixed_args()  # overrides may come before or after --flags
    try:
        return config_from_args(args), args
    except ConfigError as e:
        parser.error(str(e))


def init_ray(layout, logging: LoggingConfig | None = None, address: str | None = None) -> None:
    """Join the cluster when there is one (`ray job submit`, RAY_ADDRESS), else start a local one.

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
    # ray.init logs the dashboard's address ("View the dashboard at ...")
    ray.init(num_cpus=max(int(need + 0.999), os.cpu_count() or 1), include_dashboard=dashboard,
             dashboard_host="127.0.0.1", dashboard_port=(logging.dashboard_port or None) if dashboard else None)


def write_result(path: str | None, result: dict) -> None:
    """Print a job's result as JSON, and write it to `path` (its directory created) when given."""
    text = json.dumps(result, indent=2, default=float)
    print(text)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
