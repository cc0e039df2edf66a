"""The environment of a job, set when the `jobs` package is imported: before any entry point imports Ray.

Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, when it is imported. With "0", a local cluster's node
address is 127.0.0.1 and Ray binds its GCS, raylet, agents and workers to loopback; without it, Ray turns
`ray.init(_node_ip_address="127.0.0.1")` into the machine's own address and they listen on every
interface. A job that joins a cluster (RAY_ADDRESS set, as under `ray job submit`) keeps the cluster's
settings: the address and the authentication are the cluster's."""
from __future__ import annotations

import os

ALWAYS = {"RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false"}


def prepare_environment(environ=os.environ) -> None:
    for key, value in ALWAYS.items():
        environ.setdefault(key, value)
    if environ.get("RAY_ADDRESS"):
        return
    # a local cluster is one node on this machine: loopback, whatever the user's shell says
    environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    # on loopback, Ray's token would only stand between the user and their own dashboard
    environ.setdefault("RAY_AUTH_MODE", "disabled")
    # the local head waits this long for its dashboard to register (Ray's 60 s is missed on a loaded laptop)
    environ.setdefault("RAY_DASHBOARD_STARTUP_TIMEOUT_S", "180")
