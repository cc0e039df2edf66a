"""`ray job submit` end to end, as a user runs it: a head started with `ray start --head` on 127.0.0.1,
the training job submitted through the job API with the repository as its working_dir (conftest.py's
`watched_job`), its summary and plain-line log, and the `april_` metrics on the node's Prometheus endpoint,
read every second while it runs: every metric, and the values that must not vanish at every read."""
import re

import pytest

from actors.metrics import METRICS, shares
from april_ray.tracking import LineProgress, progress


def names(lines: list[str]) -> set[str]:
    """The metric names of the endpoint's `ray_april_*` lines."""
    return {re.sub(r"_(bucket|sum|count)$", "", m) for m in re.findall(r"^(ray_april_\w+)[{ ]", "\n".join(lines), re.M)}


@pytest.mark.slow
def test_ray_job_submit_runs_training_and_serves_metrics(watched_job):
    job = watched_job
    assert job.status == "SUCCEEDED", job.logs[-4000:]
    summary = job.summary
    assert summary["steps"] == 4 and summary["final_version"] == 4
    assert 0 <= summary["accuracy_before"] <= 1 and 0 <= summary["accuracy_after"] <= 1
    assert "\r" not in job.logs, "a progress bar's carriage returns in the job log"
    assert re.search(r"^april-ray step 4/4 \[\d+s\] .*reward=", job.logs, re.M), job.logs[-2000:]
    seen = set().union(*(names(lines) for _, lines in job.reads))
    # every metric. The reused-cache counter shows an increase only once a resumed sample found its parked
    # cache; it is there at 0 from the engine's start
    expected = {f"ray_{name}" for name in METRICS}
    assert expected == seen, (sorted(expected - seen), sorted(seen - expected))


@pytest.mark.slow
def test_accuracy_and_crashes_at_every_read_of_the_endpoint(watched_job):
    """Held-out accuracy at every read from the first evaluation (before training) on, though evaluations
    are steps apart and every step lasts over two export intervals; the crash counter, at 0, from before the
    first step ends. Up to the job's last row: the job ends after it, and its values with it."""
    reads = [(t, names(lines)) for t, lines in watched_job.reads if t <= watched_job.last_row_t]
    first_acc = next(i for i, (_, n) in enumerate(reads) if "ray_april_eval_accuracy" in n)
    missing = [round(t - reads[first_acc][0], 1) for t, n in reads[first_acc:] if "ray_april_eval_accuracy" not in n]
    assert not missing, f"accuracy absent at {len(missing)} of {len(reads) - first_acc} reads, at +{missing} s"
    first_step = next(i for i, (_, n) in enumerate(reads) if "ray_april_step" in n)
    first_crash = next(i for i, (_, n) in enumerate(reads) if "ray_april_engine_crashes_total" in n)
    assert first_crash <= first_step, "the crash counter appeared only after the first step"
    assert all("ray_april_engine_crashes_total" in n for _, n in reads[first_crash:])
    last = [lines for t, lines in watched_job.reads if t <= watched_job.last_row_t][-1]
    crash_lines = [line for line in last if line.startswith("ray_april_engine_crashes_total")]
    assert crash_lines and all(line.endswith(" 0.0") for line in crash_lines), crash_lines


def test_staleness_shares_sum_to_the_units():
    assert shares({0: 5, 1: 3, 2: 0, 4: 1}, 1000) == {0: 556, 1: 333, 4: 111}
    assert sorted(shares({0: 1, 1: 1, 2: 1}, 100).values()) == [33, 33, 34]
    assert shares({0: 99_999, 7: 1}) == {0: 100}  # a share under half a unit rounds away
    assert shares({0: 3, 7: 1}) == {0: 75, 7: 25}
    assert shares({}) == {} and shares({3: 0}) == {}


def test_progress_is_plain_lines_without_a_terminal(capsys):
    bar = LineProgress(total=2, desc="april-ray")
    bar.set_postfix({"reward": "0.25"}, refresh=False)
    bar.update()
    bar.set_postfix({"reward": "0.5", "acc": "0.4"}, refresh=False)
    bar.update()
    bar.set_postfix({"acc": "0.41"})
    lines = capsys.readouterr().out.splitlines()
    assert [re.sub(r"\[\d+s\]", "[t]", line) for line in lines] == [
        "april-ray step 1/2 [t] reward=0.25", "april-ray step 2/2 [t] reward=0.5 acc=0.4", "april-ray done [t] acc=0.41"]
    assert progress(3).__class__ is LineProgress  # pytest's stderr is not a terminal
