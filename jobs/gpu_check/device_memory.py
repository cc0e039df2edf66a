"""The device's own account of its memory while a job runs: NVML, read by a thread of the check's process
(which holds no CUDA context), per process and in all. The colocated engine's server gives its memory back
while the learner trains and takes it again for the weights and the KV cache (`EngineGroup.make_room_for_learner`),
so its process's memory drops once a step: `summary` counts those drops from the samples."""
from __future__ import annotations

import threading
import time
from pathlib import Path

ROLES = {"april_ray.engine.http_server": "engine_server", "ray::LearnerActor": "learner",
         "ray::EngineWorkerActor": "engine_actor"}
"""A process's role by what its command line holds (a Ray worker's reads `ray::<Actor>.<method>`)."""


def role_of(pid: int) -> str:
    """The role of the process `pid` in this job, `other`, or `unseen` when this PID namespace has no such
    process (NVML names the host's PIDs inside some containers)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "unseen"
    return next((role for key, role in ROLES.items() if key in cmdline), "other")


class MemorySampler:
    """Samples every `interval_s` between `start()` and `stop()`: (seconds since start, device MiB used,
    {role: MiB}), a role's processes summed. `unavailable` says why nothing was sampled (no NVML, no GPU)."""

    def __init__(self, interval_s: float = 0.1):
        self.interval_s, self.samples, self.unavailable = interval_s, [], ""
        self._stop, self._thread, self._nvml = threading.Event(), None, None

    def start(self) -> "MemorySampler":
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(0))
        except Exception as e:  # no nvidia-ml-py, no driver, no device
            self.unavailable = f"NVML: {type(e).__name__}: {e}"
            return self
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        nvml, handle = self._nvml
        t0 = time.monotonic()
        while not self._stop.wait(self.interval_s):
            roles: dict[str, float] = {}
            for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.usedGpuMemory is not None:  # None where the driver does not say (some containers)
                    role = role_of(p.pid)
                    roles[role] = roles.get(role, 0.0) + p.usedGpuMemory / 2**20
            used = nvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
            self.samples.append((time.monotonic() - t0, used, roles))

    def stop(self) -> dict:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._nvml[0].nvmlShutdown()
        return summary(self.samples, self.interval_s, self.unavailable)


def summary(samples: list, interval_s: float, unavailable: str = "") -> dict:
    """Per role and for the device: its swing (`swing`) while it lived, and the engine server's changes as
    [seconds, MiB] (`CHANGES` at most), which show each release and retake against the steps."""
    if not samples:
        return {"source": None, "why": unavailable or "no sample was taken"}
    roles = sorted({r for _, _, by_role in samples for r in by_role})
    series = {r: [by_role[r] for _, _, by_role in samples if r in by_role] for r in roles}  # while it lived
    server = [(t, by_role["engine_server"]) for t, _, by_role in samples if "engine_server" in by_role]
    return {"source": "NVML (nvmlDeviceGetComputeRunningProcesses, nvmlDeviceGetMemoryInfo)",
            "interval_s": interval_s, "samples": len(samples), "seconds": samples[-1][0],
            "device_used_mib": swing([used for _, used, _ in samples]),
            "by_role_mib": {r: swing(s) for r, s in series.items()},
            "engine_server_changes": changes(server)}


SETTLED = 0.9
"""A process has settled once it first holds this share of its largest memory (its CUDA context, weights and
KV cache made): what it held before, while starting, is no release."""
MIN_SWING_MIB = 8.0
"""A fall smaller than this from the largest is allocator noise, not a release."""
CHANGES = 4000


def swing(values: list[float]) -> dict:
    """Largest; `start_min`, the smallest before the process settled; `min`, the smallest after; `released`,
    their difference; and `drops`, each fall from above the midpoint of `max` and `min` to below it."""
    high = max(values)
    settle = next(i for i, v in enumerate(values) if v >= SETTLED * high)
    after = values[settle:]
    low = min(after)
    mid, drops, above = (high + low) / 2, 0, False
    for v in after if high - low >= MIN_SWING_MIB else ():
        if v > mid:
            above = True
        elif above and v < mid:
            drops, above = drops + 1, False
    return {"max": round(high, 1), "min": round(low, 1), "start_min": round(min(values[:settle + 1]), 1),
            "released": round(high - low, 1), "drops": drops}


def changes(series: list[tuple[float, float]]) -> list[list[float]]:
    """[seconds, MiB] at the first sample and at each change of at least 2 MiB (NVML's granularity)."""
    out: list[list[float]] = []
    for t, mib in series:
        if not out or abs(mib - out[-1][1]) >= 2:
            out.append([round(t, 2), round(mib, 1)])
    return out[:CHANGES]
