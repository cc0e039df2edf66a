"""Where the simulator's CPU goes, per sample call: a whole schedule, its control plane, and the engine
worker's own path with an engine that answers at once.

    python -m jobs.bench.simulation --config configs/qwen3_4b_dapo.yaml --gpus 64,1024 --json PATH
        [--steps 2] [--warmup 1] [key=value ...] [simulate.key=value ...]

For each GPU count, the schedules `jobs.simulate` runs (the synchronous baseline, APRIL at the config's
N'/N after `--warmup` steps, and the over-provisioned baseline at that N'/N), `--steps` measured steps
each, with the clock off: the control plane's CPU does not pass on the virtual clock, so the schedule is
the same whatever this machine's speed. Per schedule: CPU seconds per step, sample calls (requests to the engines) and engine spans
(the simulated engines' units of work, one per event) per step, and CPU per sample call, split into
the control plane's (monitor, source, store: their tasks' CPU) and the rest (engine workers, simulated
engines, the event loop). Then the worker alone: N' groups of fresh samples through the real
`LocalPool` and `EngineWorker`, on the same virtual loop, over an engine that answers every request at
once with the sample's drawn length (the output's lists as long as the simulated engine's), CPU per
sample call. `predicted_cpu_s`: what `jobs.simulate`'s 20 steps of each schedule (APRIL with its 3 warm-up
steps) take at these costs.

With `--ops`, each schedule also runs once more under a tracer that counts the Python bytecode operations
executed and the Python functions called, per sample call and by file. The count is the same on any
machine and in any run (the timings above move by 10% and more from run to run here), so it shows what a
change to the code saves; it leaves out what C functions do inside (copying a list, hashing), and the
traced run takes ~30 times as long (128 GPUs: about a minute per schedule).
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import sysconfig
import time
from collections import Counter
from pathlib import Path

from jobs.common import write_result
from april_ray.config import add_config_args
from april_ray.rollout.engine_worker import EngineWorker
from april_ray.rollout.local import LocalPool
from april_ray.rollout.prompt_source import PromptSource
from april_ray.types import FinishReason, GenerateOutput, SamplingParams
from sim import study
from sim.clock import run_virtual
from sim.cluster import InlineReward
from sim.config import study_inputs
from sim.engine import repeated

class InstantEngine:
    """Answers each request at once: the sample's drawn blocks (at most its budget), finished, version 0,
    in output lists shared as the simulated engine shares them (`sim.engine.repeated`), so that what it
    costs is little besides the output every engine makes."""

    def __init__(self, workload):
        self.workload = workload
        self.num_requests = 0

    async def generate(self, request):
        left, token = self.workload.target(self.workload.sample_key(request), request.input_ids)
        n = max(1, min(left, request.sampling.max_new_tokens))
        self.num_requests += 1
        return GenerateOutput(request.request_id, repeated(token, n), repeated(-1.0, n), repeated(0, n),
                              FinishReason.STOP)

    def abort_tagged(self, tag: str) -> int:
        return 0

    def abort_all(self) -> int:
        return 0


def worker_alone(setting, groups: int, n_samples: int, rounds: int) -> dict:
    """CPU per sample call of `LocalPool` + `EngineWorker` over `InstantEngine`s, `groups` groups a round
    spread over the setting's engines, each group one call (as the monitor sends a fresh group). Every
    sample's length is drawn before the clock starts (the draw is the simulated workload's cost, not the
    worker's: ~2 us a sample here)."""
    wl = setting.workload

    async def main(loop) -> tuple[float, int]:
        engines = [InstantEngine(wl) for _ in range(setting.num_engines)]
        workers = [EngineWorker(e, wl.decode, wl.reward, SamplingParams(max_new_tokens=wl.max_response_blocks))
                   for e in engines]
        for w in workers:
            w.reward = InlineReward(wl.reward)
        pool = LocalPool(workers, [setting.max_num_seqs] * setting.num_engines)
        source = PromptSource(wl.examples(), wl.encode, n_samples, wl.max_response_blocks, setting.seed)
        cpu = 0.0
        for r in range(rounds):
            batch = source.take(groups, r)
            for g in batch:
                for s in g.samples:
                    wl.target(s.sample_id, s.prompt_ids)
            t0 = time.process_time()
            calls = [pool.generate(i % len(workers), g.samples, ("bench", r))[0] for i, g in enumerate(batch)]
            await asyncio.gather(*calls)
            cpu += time.process_time() - t0
        return cpu, sum(e.num_requests for e in engines)

    cpu, calls = run_virtual(main)
    return {"cpu_s": cpu, "sample_calls": calls, "us_per_call": cpu / calls * 1e6}


def schedule_cost(cfg, sim, gpus: int, factor: float | None, steps: int, warmup: int, schedule: str | None = None) -> dict:
    setting = study.gpu_setting(cfg, sim, gpus)
    rollout = study.rollout_for(cfg, study.batch_for(cfg, setting.num_engines), factor, schedule)
    r = study.run_schedule(setting, rollout, steps, warmup, "none", 1.0)
    calls = r["sample_calls_per_step"]
    total = r["control_plane_cpu_s_per_step"] + r["engine_side_cpu_s_per_step"]
    return {"cpu_s_per_step": total, "sample_calls_per_step": calls, "engine_spans_per_step": r["engine_spans_per_step"],
            "us_per_call": total / calls * 1e6,
            "control_plane_us_per_call": r["control_plane_cpu_s_per_step"] / calls * 1e6,
            "rest_us_per_call": r["engine_side_cpu_s_per_step"] / calls * 1e6,
            "spans_per_call": r["engine_spans_per_step"] / calls}


def schedule_ops(cfg, sim, gpus: int, factor: float | None, steps: int, warmup: int,
                 schedule: str | None = None) -> dict:
    """Python operations and function calls per sample call of one schedule (`--ops`), in all and by file
    (paths under this repository relative to it; others from their package or standard library folder)."""
    setting = study.gpu_setting(cfg, sim, gpus)
    rollout = study.rollout_for(cfg, study.batch_for(cfg, setting.num_engines), factor, schedule)
    ops, calls = Counter(), Counter()

    def tracer(frame, event, arg):
        if event == "opcode":
            ops[frame.f_code.co_filename] += 1
        elif event == "call":
            frame.f_trace_opcodes = True
            calls[frame.f_code.co_filename] += 1
        return tracer

    previous = sys.gettrace()  # (a coverage tool's or a debugger's: it is put back)
    sys.settrace(tracer)
    try:
        r = study.run_schedule(setting, rollout, steps, warmup, "none", 1.0)
    finally:
        sys.settrace(previous)
    n = r["sample_calls_with_warmup"]  # the operations are counted over the whole run, set-up included
    by_file = Counter()
    for path, count in ops.items():
        by_file[_short(path)] += count
    return {"ops_per_call": sum(ops.values()) / n, "python_calls_per_call": sum(calls.values()) / n,
            "sample_calls": n, "ops_per_call_by_file": {f: round(c / n, 1) for f, c in by_file.most_common()}}


def _short(path: str) -> str:
    """An installed package's file from its package folder, the standard library's from the library's
    folder (`asyncio/events.py`), this repository's from its root; anything else as it is."""
    p = Path(path)
    if "site-packages" in p.parts:
        return "/".join(p.parts[len(p.parts) - p.parts[::-1].index("site-packages"):])
    for root in (STDLIB, ROOT):
        if p.is_relative_to(root):
            return str(p.relative_to(root))
    return path


ROOT = Path(__file__).resolve().parents[2]
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser)
    parser.add_argument("--gpus", default="64,1024", help="GPU counts, comma-separated")
    parser.add_argument("--steps", type=int, default=2, help="measured steps per schedule")
    parser.add_argument("--warmup", type=int, default=1, help="APRIL's steps before the measured ones")
    parser.add_argument("--json", default=None)
    parser.add_argument("--ops", action="store_true", help="also count Python operations per sample call (traced)")
    args = parser.parse_intermixed_args()
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")
    cfg, sim = study_inputs(parser, args)
    if cfg.rollout.over_sampling_batch_size == "auto":
        parser.error("rollout.over_sampling_batch_size=auto: this bench simulates a fixed N'; give an integer")
    factor = cfg.rollout.over_sampling_batch_size / cfg.rollout.rollout_batch_size
    t0 = time.time()
    rows = []
    for gpus in args.gpus:
        costs = {k: schedule_cost(cfg, sim, gpus, factor, args.steps, args.warmup if k == "april" else 0, k)
                 for k in study.SCHEDULES}  # --warmup for APRIL, as jobs.simulate warms only APRIL up
        setting = study.gpu_setting(cfg, sim, gpus)
        groups = round(factor * study.batch_for(cfg, setting.num_engines))
        worker = worker_alone(setting, groups, cfg.rollout.n_samples_per_prompt, rounds=2)
        # jobs.simulate's steps per schedule: APRIL's warm-up besides the measured ones
        steps = {k: sim.steps + study.warmup_steps(k, sim) for k in study.SCHEDULES}
        if args.ops:
            for k in study.SCHEDULES:
                costs[k]["ops"] = schedule_ops(cfg, sim, gpus, factor, args.steps, args.warmup if k == "april" else 0, k)
                o = costs[k]["ops"]
                print(f"gpus {gpus:5d}  {k:10s} {o['ops_per_call']:.0f} Python operations and "
                      f"{o['python_calls_per_call']:.1f} function calls per sample call", flush=True)
        rows.append({"gpus": gpus, "factor": factor, **costs, "worker_alone": worker,
                     "predicted_cpu_s": sum(costs[k]["cpu_s_per_step"] * steps[k] for k in costs)})
        a = costs["april"]
        print(f"gpus {gpus:5d}  APRIL {a['us_per_call']:.1f} us/call (control plane {a['control_plane_us_per_call']:.1f}, "
              f"rest {a['rest_us_per_call']:.1f}; {a['spans_per_call']:.2f} spans/call)  sync "
              f"{costs['sync']['us_per_call']:.1f}  over-provisioned {costs['oversample']['us_per_call']:.1f}  "
              f"worker alone {worker['us_per_call']:.1f}  "
              f"-> jobs.simulate ~{rows[-1]['predicted_cpu_s']:.0f} s CPU", flush=True)
    write_result(args.json, {"wall_s": time.time() - t0, "steps": args.steps, "warmup": args.warmup,
                             "results": rows})


if __name__ == "__main__":
    main()
