"""A real Prometheus (Debian's `prometheus`; .ci/run installs it) scraping a head every second through Ray's
file-based service discovery while a job runs whose steps last over twice the export interval
(conftest.py's `watched_job`): every query of cluster/grafana/april_dashboard.json returns data over the
job's window, held-out accuracy is there at every scrape after the first evaluation, every step's phase
times come back from the counters, and the crash counter reads 0 from the start."""
import json
import math

import pytest

from tests.head_job import prometheus_binary

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(prometheus_binary() is None,
                                 reason="no `prometheus` on PATH (Debian: apt-get install prometheus; .ci/run does)")]
PHASES = ("rollout", "learner", "weight_sync", "eval")


def step_rows(job) -> list[dict]:
    rows = [json.loads(line) for line in (job.out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/version" in r]


def samples(job, name: str, **labels) -> list[tuple[dict, list[tuple[float, float]]]]:
    return [(m, v) for m, v in job.raw[name] if all(m.get(k) == x for k, x in labels.items())]


def test_every_dashboard_query_returns_data(watched_job):
    assert watched_job.status == "SUCCEEDED", watched_job.logs[-3000:]
    empty = [key for key, result in watched_job.panels.items()
             if not any(math.isfinite(float(v)) for r in result for _, v in r["values"])]
    assert not empty, f"panels without data over the job's window: {empty}"
    (step,) = samples(watched_job, "ray_april_step")  # the dashboard's session variable reads its label
    assert step[0]["SessionName"].startswith("session_")


def test_accuracy_at_every_scrape_after_the_first_evaluation(watched_job):
    kinds = {labels["kind"] for labels, _ in samples(watched_job, "ray_april_eval_accuracy")}
    assert "t1" in kinds, "no held-out accuracy series"
    for kind in sorted(kinds):
        (acc,) = samples(watched_job, "ray_april_eval_accuracy", kind=kind)
        (up,) = samples(watched_job, "up", instance=acc[0]["instance"])
        first = acc[1][0][0]
        scrapes = [t for t, v in up[1] if v == 1 and first <= t <= watched_job.last_row_t]
        missing = sorted(set(scrapes) - {t for t, _ in acc[1]})
        gaps = [round(t - first, 1) for t in missing]
        assert len(scrapes) > 10 and not missing, \
            f"accuracy ({kind}) absent at {len(missing)} of {len(scrapes)} scrapes, at +{gaps} s after the first"


def distinct(values: list[tuple[float, float]]) -> list[float]:
    out = []
    for _, v in values:
        if not out or v != out[-1]:
            out.append(v)
    return out


def test_every_steps_phase_times_come_back(watched_job):
    rows = step_rows(watched_job)
    assert len(rows) == 4
    (steps,) = samples(watched_job, "ray_april_steps_total") or [({}, [])]
    assert distinct(steps[1]) == [0, 1, 2, 3, 4], f"steps seen by Prometheus: {distinct(steps[1])}"
    for phase in PHASES:
        per_step = [r.get(f"time/{phase}_s", 0.0) for r in rows]
        (total,) = samples(watched_job, "ray_april_step_phase_seconds_total", phase=phase) or [({}, [])]
        back = [b - a for a, b in zip(distinct(total[1]), distinct(total[1])[1:])]
        if phase == "eval":  # a step without evaluation adds nothing
            per_step = [t for t in per_step if t > 0]
        assert back == pytest.approx(per_step, abs=1e-3), f"{phase}: from Prometheus {back}, metrics.jsonl {per_step}"
        (last,) = samples(watched_job, "ray_april_step_phase_seconds", phase=phase)
        assert [v for v in distinct(last[1]) if v] == pytest.approx(per_step, abs=1e-6), (phase, distinct(last[1]))


def test_crashes_read_zero_from_the_start(watched_job):
    crashes = samples(watched_job, "ray_april_engine_crashes_total")
    (step,) = samples(watched_job, "ray_april_step")
    assert crashes, "no ray_april_engine_crashes_total series"
    for labels, values in crashes:
        assert values[0][0] < step[1][0][0], f"engine {labels['engine']}'s crash counter came after the first step"
        assert {v for _, v in values} == {0.0}


def test_the_mismatch_by_token_age_comes_back_as_metrics_jsonl_has_it(watched_job):
    """The learner's train-inference mismatch (`mismatch/` keys) reaches Prometheus through the dashboard's
    panels: k3 of the tokens of age 0 at every step as metrics.jsonl has it, the share of trained tokens each
    correction masks or clips, and the tokens of each age any step trained (older ones come with APRIL's
    partial rollouts, resumed after a weight update)."""
    rows = step_rows(watched_job)

    def series(title_start: str, label: str) -> dict[str, list[float]]:
        return {r["metric"][label]: distinct([(float(t), float(v)) for t, v in r["values"]])
                for (title, _), result in watched_job.panels.items() if title.startswith(title_start) for r in result}

    kl = series("KL(rollout || learner) by token age", "age")
    assert {"0", "all"} <= set(kl), sorted(kl)
    per_step = distinct([(0, r["mismatch/age0/k3"]) for r in rows])
    assert kl["0"] == pytest.approx(per_step, rel=1e-6, abs=1e-12), (kl["0"], per_step)
    assert kl["all"][-1] == pytest.approx(rows[-1]["mismatch/k3"], rel=1e-6, abs=1e-12)
    log_ratio = series("Mean log-ratio", "age")
    assert log_ratio["0"][-1] == pytest.approx(rows[-1]["mismatch/age0/log_ratio_mean"], rel=1e-6, abs=1e-12)
    shares = series("Trained tokens each correction masks or clips", "correction")
    assert set(shares) == {"tis", "icepop", "seq_mask_tis"}
    assert shares["icepop"][-1] == pytest.approx(rows[-1]["mismatch/icepop_share"], abs=1e-9)
    ages = {key.split("/")[1].removeprefix("age") for r in rows for key in r
            if key.startswith("mismatch/age") and key.endswith("/num_tokens")}
    assert "0" in ages and set(series("Trained-batch tokens by age", "age")) == ages
