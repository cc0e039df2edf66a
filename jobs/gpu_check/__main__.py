"""One command that turns a lent GPU into measurements; its default parts need no Ray, DeepSpeed or download.

    python -m jobs.gpu_check --json PATH [--budget-s 480] [--smoke] [--parts engine,schedules,learner,handoff]

Four parts by default, each in a child process of its own (its memory, and its allocator's peak, are its own), one after
the other, each stopping cleanly when its share of the budget is spent (what time a part leaves goes to the
next; a child still running 30 s past its share is stopped, and the part records that):
- engine: our engine on the device (bf16) at Qwen3-0.6B's and Qwen3-1.7B's shapes: throughput by
  concurrency and on the simulator's length mix, and the step-cost fit, beside the roofline (jobs/gpu_check/engine.py);
- schedules: sync, APRIL at N'/N 1.5 and 2, the over-provisioned baseline, in process on that engine,
  beside the simulator's prediction (jobs/gpu_check/schedules.py);
- learner: one step of the `Learner` at the paper's settings, 1.7B and a Qwen3-4B slice, the allocator's peak
  against the memory plan (jobs/gpu_check/learner.py);
- handoff: CUDA-IPC weight updates from this process tree's learner into an engine server process on the
  same device (jobs/gpu_check/handoff.py).
Two more run only when asked for, with Ray and DeepSpeed from the carried bundle (docs/gpu.md):
- job_shape: the training job at Qwen3-0.6B's shape, its step split beside the same rollout and learner step in
  process (the torch backend's and DeepSpeed ZeRO-1's) and the simulator's (jobs/gpu_check/job_shape.py);
- job: the training job itself under Ray, colocated and overlapped on the device (jobs/gpu_check/job.py).
The JSON has one key per part and `device`; a short table is printed. `--smoke` runs every part on CPU with
tiny shapes (tests/test_gpu_check.py). docs/gpu.md says what to carry to a lent machine and the command.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # the children's saves and loads, in a log

from jobs.gpu_check.common import GPU_SCALE, SMOKE_SCALE, Deadline, accelerator_key, write_json

PARTS = {"engine": 0.3, "schedules": 0.3, "learner": 0.25, "handoff": 0.15}
"""The default parts, each with its share of the budget."""
SHARES = PARTS | {"job_shape": 0.9, "job": 1.0}
"""Every part's share; `job` (asked for by name) weighs as much as the other four together, `job_shape` (asked
for by name, run before `job`) nearly as much (docs/gpu.md: the budget of a call that runs both)."""
GRACE_S = 30.0


def device_info(smoke: bool, budget_s: float) -> dict:
    import torch

    cuda = torch.cuda.is_available() and not smoke
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    scale = SMOKE_SCALE if smoke else GPU_SCALE
    return {"name": name, "type": "cuda" if cuda else "cpu", "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "memory_gb": torch.cuda.get_device_properties(0).total_memory / 1e9 if cuda else None,
            "roofline_card": accelerator_key(name) + ("" if cuda and accelerator_key(name) in name.lower()
                                                      else " (nominal: this device is not one sim/hardware.py knows)"),
            "cpus": os.cpu_count(), "budget_s": budget_s, "smoke": smoke, "length_scale": scale.length_scale,
            "python": sys.version.split()[0]}


def run_parts(args) -> dict:
    """The parts one after the other; the device is read last (this process holds no CUDA context meanwhile)."""
    start, result, walls = time.time(), {}, {}
    parts = [p for p in SHARES if p in args.parts.split(",")]
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as work:
        for i, part in enumerate(parts):
            left = start + args.budget_s - time.time()
            share = left * SHARES[part] / sum(SHARES[p] for p in parts[i:])
            result[part] = run_child(part, time.time() + share, Path(work), args.smoke)
            walls[part] = {"budget_s": share, "wall_s": result[part].pop("_wall_s")}
    device = device_info(args.smoke, args.budget_s) | {"parts": walls, "wall_s": time.time() - start}
    return {"device": device} | result


def run_child(part: str, deadline: float, work: Path, smoke: bool) -> dict:
    out = work / f"{part}.json"
    cmd = [sys.executable, "-m", "jobs.gpu_check", "--part", part, "--deadline", repr(deadline), "--work", str(work),
           "--out", str(out)] + (["--smoke"] if smoke else [])
    t0 = time.time()
    try:
        code = subprocess.run(cmd, timeout=max(1.0, deadline - t0) + GRACE_S).returncode
    except subprocess.TimeoutExpired:
        code = "killed"
    res = json.loads(out.read_text()) if out.exists() else {}
    if code != 0 and "error" not in res:  # what it had finished is kept beside
        res["error"] = f"the part's process ended with {code} (its output is above)"
    return res | {"_wall_s": time.time() - t0}


def one_part(args) -> None:
    """In the child: the part on this device, its JSON to `--out` (an error too, with its traceback printed)."""
    import torch

    from jobs.gpu_check import engine, handoff, job, job_shape, learner, schedules

    scale = SMOKE_SCALE if args.smoke else GPU_SCALE
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # as the CPU engine runs (engine.num_threads)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    deadline, work, out = Deadline(args.deadline), Path(args.work), Path(args.out)

    def progress(partial: dict) -> None:  # what a part has so far, kept should its process be stopped
        write_json(out, partial)

    runs = {"engine": lambda: engine.run(scale, device, dtype, deadline, progress),
            "schedules": lambda: schedules.run(scale, device, dtype, deadline),
            "learner": lambda: learner.run(scale, device, work, deadline, progress),
            "handoff": lambda: handoff.run(scale, device, dtype, work, deadline),
            "job_shape": lambda: job_shape.run(args.smoke, work, deadline, progress),
            "job": lambda: job.run(args.smoke, work, deadline, progress)}
    try:
        result = runs[args.part]()
    except Exception as e:
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    write_json(out, result)


def table(result: dict) -> str:
    d = result["device"]
    lines = [f"device: {d['name']} (roofline: {d['roofline_card']}), torch {d['torch']}, {d['wall_s']:.0f} s "
             f"of a {d['budget_s']:.0f} s budget"]
    from jobs.gpu_check.job import lines as job_lines
    from jobs.gpu_check.job_shape import lines as job_shape_lines

    for part, rows in (("engine", engine_lines), ("schedules", schedule_lines), ("learner", learner_lines),
                       ("handoff", handoff_lines), ("job_shape", job_shape_lines), ("job", job_lines)):
        if part in result:
            lines += [f"{part}: {result[part]['error']}"] if "error" in result[part] else rows(result[part])
    return "\n".join(lines)


def _get(d: dict, key: str) -> float:
    return d.get(key) if d.get(key) is not None else float("nan")


def engine_lines(res: dict) -> list[str]:
    lines = []
    for name, r in res.items():
        if "by_concurrency" not in r:
            continue
        top = max(r["by_concurrency"], key=lambda p: (p["context_per_row"], p["rows"]), default=None)
        if top:
            lines.append(f"engine {name}: {top['rows']} rows x {top['context_per_row']:.0f} tokens: "
                         f"{top['tok_s']:.0f} tok/s, step {top['decode_step_s'] * 1e3:.2f} ms "
                         f"(roofline {top['roofline_step_s'] * 1e3:.2f} ms)")
        prof = r.get("decode_profile")
        if prof:
            device = "" if prof["device_s_per_step"] is None else (
                f", device {prof['device_s_per_step'] * 1e3:.2f} ms in {prof['device_ops_per_step']:.0f} kernels and copies")
            lines.append(f"  profile at {prof['rows']} rows: step {prof['step_s'] * 1e3:.2f} ms, host ops "
                         f"{prof['host_op_s_per_step'] * 1e3:.2f} ms{device}")
        for m in r["length_mix"]:
            lines.append(f"  mix at {m['concurrency']} rows: {m['tok_s']:.0f} tok/s; simulated "
                         f"{_get(m, 'simulated_tok_s_roofline'):.0f} (roofline), "
                         f"{_get(m, 'simulated_tok_s_fitted'):.0f} (fitted)")
        fit, roof = r["step_cost"]["fit"], r["step_cost"]["roofline"]
        if fit:
            lines.append(f"  fit: a {fit['a'] * 1e3:.3f} ms/step (roofline {roof['fixed_per_step'] * 1e3:.3f}), "
                         f"b {fit['b'] * 1e6:.2f} us/row, "
                         f"c {fit['c'] * 1e9:.2f} ns/context token, "
                         f"prefill {fit['prefill_per_token'] * 1e6:.3f} us/token")
    return lines


def schedule_lines(res: dict) -> list[str]:
    lines = ["schedules (utilization: measured | simulated fitted | roofline; gain over sync):"]
    for name, m in res.get("modes", {}).items():
        lines.append(f"  {name:14s} {m['utilization']:.3f} | {_get(m, 'simulated_utilization_fitted'):.3f} | "
                     f"{_get(m, 'simulated_utilization_roofline'):.3f}; gain {_get(m, 'gain_over_sync'):.2f} "
                     f"(simulated {_get(m, 'simulated_gain_over_sync_fitted'):.2f})")
    return lines


def learner_lines(res: dict) -> list[str]:
    lines = []
    for name, r in res.items():
        if isinstance(r, dict) and "step_s" in r:
            lines.append(f"learner {name}: {r['tokens']} tokens, step {r['step_s']:.2f} s, "
                         f"{r['tokens_per_s']:.0f} tok/s, peak {r['peak_gb']:.2f} GB, plan {r['plan_gb']:.2f} GB "
                         f"(plan/peak {r['plan_over_peak']:.2f})")
        elif isinstance(r, dict):
            lines.append(f"learner {name}: {r.get('error') or r.get('skipped')}")
    return lines


def handoff_lines(res: dict) -> list[str]:
    if not res.get("s_per_update"):
        return ["handoff: no update within the budget"]
    return [f"handoff: {res['updates']} updates of {res['gb']:.3f} GB, {res['s_per_update']:.3f} s each "
            f"({res['gb_per_s']:.1f} GB/s); served version {res['served_version_after']}"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--budget-s", type=float, default=480.0, help="seconds for all the parts together")
    p.add_argument("--smoke", action="store_true", help="every part on CPU with tiny shapes")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated, of " + ", ".join(SHARES))
    p.add_argument("--part", choices=list(SHARES), help=argparse.SUPPRESS)  # one part, in a child process
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.part:
        one_part(args)
        return
    if not args.json:
        p.error("--json PATH is required")
    bad = set(args.parts.split(",")) - set(SHARES)
    if bad:
        p.error(f"--parts: unknown {', '.join(sorted(bad))} (of {', '.join(SHARES)})")
    result = run_parts(args)
    write_json(Path(args.json), result)
    print(table(result))


if __name__ == "__main__":
    main()
