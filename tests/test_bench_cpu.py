"""The benchmark's CPU seconds by role: a real child process, named as a Ray actor's worker, sampled."""
import subprocess
import sys
import time

import psutil
import pytest

from jobs.bench.cpu import JobCpu, Series, per_step, role_of, training_windows

BUSY = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\ntime.sleep(1.5)"
"""Half a second of CPU, then a pause, so a sample sees the child's CPU before it ends."""


def sampled(cmd: list[str]) -> tuple[JobCpu, float, float]:
    """`cmd` run to its end with its process tree sampled (not the test process's: the suite's shared jobs
    run under it meanwhile); (the samples, its start, its end)."""
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd)
    with JobCpu(period_s=0.2, root=psutil.Process(child.pid)) as cpu:
        assert child.wait() == 0
        t1 = time.perf_counter()
    return cpu, t0, t1


def test_a_child_titled_as_an_engine_actor_counts_as_engines():
    cpu, t0, t1 = sampled(["bash", "-c", f'exec -a "ray::EngineWorkerActor.generate" {sys.executable} -c "$0"', BUSY])
    seconds = cpu.within([(t0, t1)])
    assert seconds["engines"] >= 0.4 and seconds["learner"] == 0.0
    assert seconds["machine"] >= seconds["engines"]
    assert cpu.within([(t1, t1 + 100)])["engines"] == 0.0  # nothing after the child ended


def test_roles_windows_and_interpolation():
    assert role_of("ray::LearnerActor.train") == "learner" and role_of("ray::StoreActor.put") == "other"
    assert role_of("ray::IDLE") is None and role_of("/usr/bin/raylet") == "other"
    s = Series(0.0, 0.0)
    s.add(2.0, 1.0)
    assert s.at(1.0) == 0.5 and s.at(-1) == 0.0 and s.at(9) == 1.0
    assert s.within([(0.0, 1.0), (1.5, 2.0)]) == pytest.approx(0.75)
    rows = [{"time/wall_s": 1.0}, {"time/wall_s": 3.0, "time/eval_s": 0.5}, {"time/wall_s": 4.0}]
    assert training_windows(rows, 10.0) == [(10.0, 11.0), (11.0, 12.5), (13.0, 14.0)]
    assert per_step({"engines": 4.0, "learner": 2.0, "other": 2.0, "machine": 10.0}, 2)["engines"] == 2.0


def test_a_worker_that_becomes_an_actor_takes_the_actors_role():
    cpu, t0, t1 = sampled([sys.executable, "-c", "import os, sys, time; time.sleep(0.6); "
                           "os.execv('/bin/bash', ['bash', '-c', 'exec -a ray::LearnerActor.train ' + sys.executable "
                           "+ ' -c \"$0\"', sys.argv[1]])", BUSY])
    assert cpu.within([(t0, t1)])["learner"] >= 0.4
