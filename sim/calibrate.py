"""The simulator against measurement: the CPU engine's step costs and the tiny task's response lengths.

The step costs come from `jobs/bench/schedule.py`'s runs: its `StepRecorder` (jobs/bench/steplog.py)
records every step of the real CPU engine (`LLMEngine.step`, the tiny model, one torch thread) while it
serves the real schedules in process (the synchronous baseline and APRIL at N'/N = 1.5 and 3, interleaved
step by step with a saturated probe after every round, so the machine's drift falls on all of them alike):
the step's running rows, the context its decoding rows hold, the tokens it prefilled, and its CPU time (the
thread's: a shared machine's load would swamp wall-clock times; and the process's other threads do not
belong to the step). `fit_costs` fits

    step = a + b * rows + c * context + per_attended * attended
           + prefill_per_token * prefilled + prefill_per_step * (any prefill) + ...

so the fit sees the batches these schedules really make (mixed lengths, resumed inputs, prompts joining a
busy batch). `attended` is the span the decode attends over, each row padded to the longest context of
its span class (`model_runner.decode_segments`): rows that started together pad nothing (the synchronous
baseline's, 1.00 of the context), rows of every age pad half as much again (APRIL's and the probe's,
1.5-1.6); the simulated engine pads its rows the same way (sim/engine.py). One feature has no
counterpart there, which has no row layout: a step that regroups its rows (about 1% of the probe's time;
left out). A uniform grid of batches (every row the same context) is timed too, as a cross-check of the
decode curve; it is not what the simulation uses (`grid_fit` in the output).

The bench also measures the process's CPU outside engine steps per request (front end, engine worker,
monitor, reward threads: they share the engine's one core) and at the step boundary per aborted request
(the abort parks each cache; the store). `--calibrate` simulates a bench run with the costs of that run
itself (`step_costs` in its JSON): they come from the minutes its utilizations were measured in (this
machine's speed drifts by 10% within minutes). `--measure-cpu` (`measure`) runs the bench once more for
costs of its own (a cross-check, and the costs of a bench JSON that has none; its utilizations are the
"in situ" comparison), times the grid, and records the response lengths the model really produces
(temperature and budget of the config) for the first prompts of the prompt source's order, each
prompt's samples together. `cpu_setting` is then one simulated engine with those costs and lengths, as
the bench runs one real engine: the bench's measured utilizations are what the simulation must predict.
"""
from __future__ import annotations

import time

import numpy as np

from april_ray.config import Config
from sim.cluster import Setting
from sim.hardware import StepCost
from sim.workload import LengthModel, Workload

FEATURES = ("one", "rows", "context", "prefilled", "any_prefill", "admitted", "restored", "regrouped", "attended")
"""What an engine step's cost is fitted on: the columns of the rows `StepRecorder` records, its CPU time last."""
COSTS = ("a", "b", "c", "prefill_per_token", "prefill_per_step", "per_admitted", "per_restored_token", "per_regroup",
         "per_attended")
"""The fit's cost of each feature, in `FEATURES` order."""


GRID_ROWS = (1, 4, 16, 32, 64)
GRID_CONTEXTS = (8, 96, 192, 320, 480)


def _time_grid(model, cfg: Config, vocab: int, passes: int = 2, steps: int = 10) -> list[dict]:
    """Uniform batches: `rows` inputs of `ctx` tokens admitted at once, then decode steps; each point the
    fastest over `passes` sweeps (on a loaded machine even CPU time inflates: a busy sibling hyperthread,
    evicted caches; the least disturbed run is the engine's own cost)."""
    from april_ray.engine.cpu_engine import LLMEngine
    from april_ray.types import GenerateRequest, SamplingParams

    rng, best = np.random.default_rng(0), {}
    for _ in range(passes):
        for ctx in GRID_CONTEXTS:
            for rows in GRID_ROWS:
                e = LLMEngine(model, max_num_seqs=max(GRID_ROWS), max_model_len=cfg.engine.max_model_len,
                              max_prefill_tokens=cfg.engine.max_prefill_tokens)
                sp = SamplingParams(temperature=1.0, max_new_tokens=steps + 2)
                for i in range(rows):
                    e.add_request(GenerateRequest(f"r{i}", rng.integers(3, vocab, ctx).tolist(), sp))
                t0 = time.thread_time()
                e.step()
                prefill = time.thread_time() - t0
                decode = []
                for _ in range(steps):
                    t0 = time.thread_time()
                    e.step()
                    decode.append(time.thread_time() - t0)
                old = best.get((rows, ctx), (prefill, min(decode)))
                best[(rows, ctx)] = (min(old[0], prefill), min(old[1], min(decode)))
    return [{"rows": r, "context": c + steps / 2, "prefill_s": p, "decode_s": d} for (r, c), (p, d) in best.items()]


def fit_grid(points: list[dict]) -> dict:
    """decode = a + b * rows + c * rows * context; prefill step = decode step + per_token * rows * context."""
    x = np.array([[1.0, p["rows"], p["rows"] * p["context"]] for p in points])
    (a, b, c), *_ = np.linalg.lstsq(x, np.array([p["decode_s"] for p in points]), rcond=None)
    extra = np.array([p["prefill_s"] - (a + b * p["rows"]) for p in points])
    tokens = np.array([p["rows"] * p["context"] for p in points])
    per_token = float(extra @ tokens / (tokens @ tokens))
    return {"a": float(a), "b": float(b), "c": float(c), "prefill_per_token": per_token}


def fit_costs(rows: list[tuple]) -> dict:
    """Least squares with every cost >= 0: a feature whose cost comes out negative (it moves with others,
    e.g. admissions with prefilled tokens) is dropped, the most negative first, and the rest refitted."""
    x, y = np.array([r[:-1] for r in rows], dtype=float), np.array([r[-1] for r in rows])
    keep, coef = list(range(x.shape[1])), np.zeros(x.shape[1])
    while keep:
        sol, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if sol.min() >= 0:
            coef[keep] = sol
            break
        keep.pop(int(np.argmin(sol)))
    rel = np.abs(x @ coef - y) / y
    return dict(zip(COSTS, map(float, coef))) | {
        "steps": len(rows), "rel_error_median": float(np.median(rel)), "rel_error_p90": float(np.percentile(rel, 90))}


def measure_lengths(model, tok, cfg: Config, train, num_prompts: int) -> dict[int, list[int]]:
    """Response lengths of `n_samples_per_prompt` samples for each of the first prompts in the source's order."""
    from april_ray.engine.cpu_engine import LLMEngine
    from april_ray.rollout.prompt_source import PromptSource
    from april_ray.types import GenerateRequest, SamplingParams

    source = PromptSource(train, tok.encode, cfg.rollout.n_samples_per_prompt, cfg.sampling.max_response_len,
                          cfg.task.seed)
    groups = source.take(num_prompts)
    engine = LLMEngine(model, max_num_seqs=cfg.engine.max_num_seqs, max_model_len=cfg.engine.max_model_len,
                       max_prefill_tokens=cfg.engine.max_prefill_tokens, seed=cfg.engine.seed)
    sp = SamplingParams(cfg.sampling.temperature, cfg.sampling.top_p, cfg.sampling.top_k,
                        cfg.sampling.max_response_len, (tok.eos_token_id,))
    reqs = [GenerateRequest(s.sample_id, s.prompt_ids, sp) for g in groups for s in g.samples]
    outs = engine.generate(reqs)
    by_row: dict[int, list[int]] = {}
    for g, i in zip(groups, range(0, len(outs), source.n)):
        by_row[g.prompt_index] = [o.num_tokens for o in outs[i:i + source.n]]
    return by_row


def between_costs(between: dict) -> dict[str, float]:
    """The engine thread's CPU between engine steps, split into per step and per request: least squares
    over the schedules' totals (non-negative), and the probe's own per step."""
    modes = [m for m in between["by_mode"] if m != "probe"]
    a = np.array([[between["by_mode"][m]["steps"], between["by_mode"][m]["requests"]] for m in modes], dtype=float)
    b = np.array([between["by_mode"][m]["between_s"] for m in modes])
    (per_step, per_request), *_ = np.linalg.lstsq(a, b, rcond=None)
    if min(per_step, per_request) < 0:
        per_step, per_request = (0.0, b.sum() / a[:, 1].sum()) if per_step < 0 else (b.sum() / a[:, 0].sum(), 0.0)
    probe = between["by_mode"]["probe"]
    return {"per_step": float(per_step), "per_request": float(per_request),
            "probe_per_step": probe["between_s"] / max(1, probe["steps"]),
            "per_aborted": between["boundary_per_aborted"]}


def cpu_step_cost(fit: dict, per_request: float = 0.0, per_aborted: float = 0.0, per_step: float = 0.0) -> StepCost:
    """The fitted CPU costs (a prompt that joins a running batch is prefilled in its decode pass,
    `LLMEngine.step`, so a prefill adds to that step), plus `per_request` of CPU a request costs its
    callers on the engine's thread, and `per_aborted` of step boundary per aborted request."""
    return StepCost(per_step, ((fit["a"], fit["b"], fit["c"]),), fit["prefill_per_token"], 0.0, fit["prefill_per_step"],
                    fit["per_admitted"] + per_request, fit["per_restored_token"], per_aborted,
                    fit.get("per_attended", 0.0))


def cpu_setting(cfg: Config, measured: dict, prompt_lens: list[int], per_request: float = 0.0,
                per_aborted: float = 0.0, per_step: float = 0.0, by_sample: dict[str, int] | None = None) -> Setting:
    """One simulated CPU engine as `jobs/bench/schedule.py` runs one: the config's cap, budget, parked
    caches and stale-cache reuse; lengths of the task as the model produced them (one token a block)."""
    from april_ray.config import StalenessConfig

    by_row = {int(k): v for k, v in measured["by_row"].items()}
    lengths = LengthModel("task", 1.0, 1.0, 1.0, cfg.task.seed, rows=by_row, by_sample=by_sample)
    workload = Workload(lengths, prompt_lens, 1, cfg.sampling.max_response_len, 0.0, cfg.task.seed)
    e = cfg.engine
    stale = cfg.staleness.kv_max_versions(e.reuse_stale_kv)
    slots = e.max_num_seqs * e.max_model_len  # the CPU engine's cache: a slot of max_model_len per row
    return Setting(workload, cpu_step_cost(measured["fit"], per_request, per_aborted, per_step), 1, e.max_num_seqs, slots,
                   e.max_prefill_tokens, StalenessConfig(cfg.staleness.max_versions, cfg.staleness.policy),
                   e.park_slots, stale, cfg.task.seed)


def measure(cfg: Config, schedules: dict, num_prompts: int = 320) -> dict:
    """`--measure-cpu`: the step costs of `schedules` (a `jobs.bench.schedule` result), the uniform grid,
    and the tiny model's response lengths."""
    import torch

    from april_ray.model import load_policy
    from april_ray.task.data import dataset_paths, read_examples
    from april_ray.task.embedded_model import ensure_model

    train_path, _ = dataset_paths(cfg.task, cfg.model.cache_dir)
    train = read_examples(train_path, cfg.task.prompt_key, cfg.task.answer_key)
    torch.set_num_threads(cfg.engine.num_threads)
    model, tok = load_policy(str(ensure_model(cfg)))
    grid = _time_grid(model, cfg, len(tok))
    by_row = measure_lengths(model, tok, cfg, train, num_prompts)
    lengths = [x for v in by_row.values() for x in v]
    costs = schedules["step_costs"]
    modes = [m for m in costs["sums"] if m != "probe"]
    return {"fit": costs["fit"], "grid_fit": fit_grid(grid), "grid": grid, "between_steps": costs["between_steps"],
            "in_situ": {m: {k: schedules[m][k] for k in ("utilization", "cpu_utilization")} for m in modes},
            "by_row": {str(k): v for k, v in by_row.items()},
            "setup": {"threads": cfg.engine.num_threads, "schedule_steps": schedules["sync"]["steps"],
                      "prompts": num_prompts, "temperature": cfg.sampling.temperature,
                      "max_response_len": cfg.sampling.max_response_len,
                      "response_len_mean": float(np.mean(lengths)), "response_len_p99": float(np.percentile(lengths, 99))}}


def bench_settings(cfg: Config, costs: dict, prompt_lens: list[int]) -> tuple[Setting, Setting]:
    """Under `costs`: the bench's engine (its callers' CPU per request, per step and per aborted request on
    its thread) and the probe's (the probe's own CPU per step)."""
    between = between_costs(costs["between_steps"])
    return (cpu_setting(cfg, costs, prompt_lens, between["per_request"], between["per_aborted"], between["per_step"]),
            cpu_setting(cfg, costs, prompt_lens, per_step=between["probe_per_step"]))


def attended_per_context(measured: dict, mode: str) -> float | None:
    """The padded attention span over the context, over the bench's engine steps of `mode` (if recorded)."""
    sums = measured.get("step_costs", {}).get("sums", {}).get(mode)
    return sums["attended"] / max(1.0, sums["context"]) if sums else None


GAP_BINS_MS = (0.0, 0.05, 0.2, 1.0, 5.0, float("inf"))


def fit_by_gap(fit: dict, recorded: dict[str, list[tuple]], gaps: dict[str, list[float]]) -> dict[str, list[dict]]:
    """Per mode, the fit's CPU over the measured CPU of its steps binned by the CPU the thread spent on
    other work just before each (`StepRecorder.gaps`, in ms; bins of at least 20 steps)."""
    coef = np.array([fit[c] for c in COSTS])
    out = {}
    for mode, rows in recorded.items():
        if not rows:
            continue
        x, y = np.array([r[:-1] for r in rows], dtype=float), np.array([r[-1] for r in rows])
        gap = np.array(gaps[mode]) * 1e3
        out[mode] = []
        for lo, hi in zip(GAP_BINS_MS, GAP_BINS_MS[1:]):
            sel = (gap >= lo) & (gap < hi)
            if sel.sum() >= 20:
                out[mode].append({"gap_ms": [lo, hi if hi != float("inf") else None], "steps": int(sel.sum()),
                                  "rows_mean": float(x[sel, 1].mean()),
                                  "fit_over_measured": float((x[sel] @ coef).sum() / y[sel].sum())})
    return out


def fit_over_measured(measured: dict) -> dict[str, float]:
    """Per mode of a bench run (its probe included): the CPU its own fit gives the engine steps of that
    mode, over the CPU they measured (1: the fit's error averages out over that mode's steps)."""
    costs = measured.get("step_costs", {})
    fit = costs.get("fit", {})
    return {mode: sum(fit[c] * s[f] for c, f in zip(COSTS, FEATURES)) / s["cpu_s"]
            for mode, s in costs.get("sums", {}).items()}


def bench_probe(cfg: Config, setting: Setting, measured: dict) -> tuple[float, float]:
    """The bench's own ceiling probe simulated (`cluster.restarted_probe`: lanes restarted in lockstep each
    time, on the prompts the schedules start with, `--probe-seconds` after a second of warm-up, as
    `jobs/bench/schedule.py` measures it): (tokens per virtual second, mean context per running row)."""
    from april_ray.rollout.prompt_source import first_prompts
    from sim.clock import run_virtual
    from sim.cluster import restarted_probe

    wl = setting.workload
    rows = [ids[0] for ids in first_prompts(wl.examples(), wl.encode, cfg.task.seed, 512)]
    window = measured["config"].get("probe_seconds", 2.0)

    async def main(loop):
        return await restarted_probe(setting, loop, rows, cfg.rollout.n_samples_per_prompt, 1.0, window)

    return run_virtual(main)


def calibrate(cfg: Config, sim, costs: dict, measured: dict) -> dict:
    """`--calibrate`: bench_schedule's setting (one engine, its N and factors, steps and warm-up) simulated
    with the measured costs and lengths. `shared`: the control plane and the engine workers share the
    engine's thread (their CPU holds the engine up), as in the bench; `free`: they cost no time."""
    from transformers import AutoTokenizer

    from april_ray.task.embedded_model import ensure_model
    from sim import study
    from april_ray.task.data import dataset_paths, read_examples

    tok = AutoTokenizer.from_pretrained(str(ensure_model(cfg)))
    train_path, _ = dataset_paths(cfg.task, cfg.model.cache_dir)
    prompt_lens = [len(tok.encode(ex.prompt)) for ex in read_examples(train_path, cfg.task.prompt_key,
                                                                       cfg.task.answer_key)]
    in_situ = costs["in_situ"]  # the same schedules' utilizations, measured with the costs
    recording = costs
    own = bool(measured.get("step_costs"))  # the bench's own engine steps: costs from the minutes it measured in
    if own:
        costs = costs | {"fit": measured["step_costs"]["fit"], "between_steps": measured["step_costs"]["between_steps"]}
    between = between_costs(costs["between_steps"])
    setting, probe_setting = bench_settings(cfg, costs, prompt_lens)
    bare = cpu_setting(cfg, costs, prompt_lens)
    bench = measured["config"]
    n, steps, warmup = bench["rollout_batch_size"], measured["sync"]["steps"], sim.warmup_steps
    ceiling = study.ceiling_of(probe_setting, cfg.rollout.n_samples_per_prompt)
    bare_ceiling = study.ceiling_of(bare, cfg.rollout.n_samples_per_prompt)
    probe_rate, probe_context = bench_probe(cfg, probe_setting, measured)
    if own:  # cross-check: the same with the costs of `--measure-cpu`'s own bench run
        rec_setting, rec_probe_setting = bench_settings(cfg, recording, prompt_lens)
        rec_probe_rate, _ = bench_probe(cfg, rec_probe_setting, measured)
    modes = [("sync", None, "sync")] + [(f"{k}_{f:g}", f, k) for f in bench["factors"] for k in ("april", "oversample")
                                        if k == "april" or f"{k}_{f:g}" in measured]  # the baseline's if measured
    rows = []
    for name, f, schedule in modes:
        rollout = study.rollout_for(cfg, n, f, schedule)
        sim_ = study.run_schedule(setting, rollout, steps, warmup, "none", ceiling)
        alone = study.run_schedule(bare, rollout, steps, warmup, "none", bare_ceiling)
        m = measured[name]
        replayed = None
        if m.get("sample_lengths"):  # the bench's own lengths, sample by sample (each mode drew its own)
            replay = cpu_setting(cfg, costs, prompt_lens, between["per_request"], between["per_aborted"],
                                 between["per_step"], by_sample=m["sample_lengths"])
            replayed = study.run_schedule(replay, rollout, steps, warmup, "none", ceiling)["effective_tok_s"] / probe_rate
        with_recording = None
        if own:
            with_recording = study.run_schedule(rec_setting, rollout, steps, warmup, "none", ceiling)["effective_tok_s"] \
                / rec_probe_rate
        here = in_situ.get(name, {}).get("utilization")
        cpu, cpu_here = m.get("cpu_utilization"), in_situ.get(name, {}).get("cpu_utilization")
        rows.append({"mode": name, "factor": f, "measured_utilization": m["utilization"],
                     "simulated_utilization": sim_["utilization"], "error": sim_["utilization"] - m["utilization"],
                     "simulated_vs_bench_probe": sim_["effective_tok_s"] / probe_rate,
                     "bench_probe_error": sim_["effective_tok_s"] / probe_rate - m["utilization"],
                     "replayed_vs_bench_probe": replayed,
                     "replayed_error": None if replayed is None else replayed - m["utilization"],
                     "recording_costs_vs_bench_probe": with_recording,
                     "recording_costs_error": None if with_recording is None else with_recording - m["utilization"],
                     "measured_cpu_utilization": cpu, "cpu_error": None if cpu is None else sim_["utilization"] - cpu,
                     "in_situ_utilization": here, "in_situ_error": None if here is None else sim_["utilization"] - here,
                     "in_situ_cpu_utilization": cpu_here,
                     "in_situ_cpu_error": None if cpu_here is None else sim_["utilization"] - cpu_here,
                     "simulated_engine_alone": alone["utilization"],
                     "measured_rows": m["running_rows_mean"], "simulated_rows": sim_["running_rows_per_step"],
                     "measured_off_policy": m["off_policy_token_ratio"],
                     "simulated_off_policy": sim_["off_policy_token_ratio"],
                     "measured_prefill_per_decoded": m["prefill_per_decoded"],
                     "simulated_prefill_per_decoded": sim_["prefill_per_decoded"],
                     "measured_reused_kv_per_decoded": m.get("engine_reused_kv_tokens", 0) / max(1, m.get("engine_decoded_tokens", 0)),
                     "simulated_reused_kv_per_decoded": sim_["reused_kv_per_decoded"],
                     "measured_attended_per_context": attended_per_context(measured, name),
                     "simulated_attended_per_context": sim_["attended_per_context"],
                     "simulated_control_plane_cpu_s_per_step": sim_["control_plane_cpu_s_per_step"],
                     "duplicated_samples": sim_["duplicated_samples"] + alone["duplicated_samples"],
                     "samples_with_wrong_length": sim_["samples_with_wrong_length"] + alone["samples_with_wrong_length"]})
        print(f"{name:10s} measured {m['utilization']:.3f}, CPU {cpu or float('nan'):.3f} (in situ {here or float('nan'):.3f}, "
              f"CPU {cpu_here or float('nan'):.3f})  simulated {sim_['utilization']:.3f} "
              f"(engine alone {alone['utilization']:.3f}; over the bench's probe {rows[-1]['simulated_vs_bench_probe']:.3f}, "
              f"with the bench's own lengths {replayed or float('nan'):.3f}; with the recording's costs "
              f"{with_recording or float('nan'):.3f})", flush=True)
    print(f"ceiling: simulated {ceiling:.0f} tok/s (steady state), the bench's restarted probe simulated "
          f"{probe_rate:.0f} tok/s (context {probe_context:.1f} per row)", flush=True)
    fit_ratio = fit_over_measured(measured)
    if fit_ratio:
        print("the bench's fit over its measured engine steps: " +
              ", ".join(f"{m} {r:.3f}" for m, r in fit_ratio.items()), flush=True)
    return {"ceiling_tok_s": {"measured": measured["saturated_tok_s"], "simulated": ceiling,
                              "simulated_bench_probe": probe_rate},
            "bench_probe_context_per_row": probe_context,
            "fit_over_measured_steps": fit_ratio,
            "comparison": rows, "within_0.05": all(abs(r["error"]) <= 0.05 for r in rows),
            "within_0.05_bench_probe": all(abs(r["bench_probe_error"]) <= 0.05 for r in rows),
            "within_0.05_replayed": all(r["replayed_error"] is not None and abs(r["replayed_error"]) <= 0.05 for r in rows),
            "within_0.05_cpu": all(r["cpu_error"] is not None and abs(r["cpu_error"]) <= 0.05 for r in rows),
            "within_0.05_in_situ": all(r["in_situ_error"] is not None and abs(r["in_situ_error"]) <= 0.05 for r in rows),
            "setup": {"rollout_batch_size": n, "steps": steps, "warmup_steps": warmup,
                      "costs_from": "the bench run's own engine steps" if own else "the --measure-cpu recording",
                      "fit": costs["fit"],
                      "between_steps": between,
                      "lengths": {k: costs["setup"][k] for k in ("response_len_mean", "response_len_p99", "prompts")}}}
