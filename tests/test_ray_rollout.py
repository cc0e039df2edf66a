"""APRIL on a real local Ray: EngineWorkers on the CPU engine, the monitor, store and source actors.

Several raylets on one machine (`ray.cluster_utils.Cluster`) stand in for a multi-node cluster; logical
GPUs stand in for real ones in the placement math.
"""

import hashlib
from pathlib import Path

import pytest
import ray

import driver.rollout

from actors.prompt_source import PromptSourceActor
from actors.refs import fetch
from actors.store import with_refs
from april_ray.config import load_config
from april_ray.placement import plan
from april_ray.task.data import dataset_paths
from driver.engines import EngineGroup, settle
from driver.rollout import RolloutGroup
from april_ray.types import Group, SampleState

pytestmark = pytest.mark.slow


def small_cfg(tmp_path, *extra):
    return load_config(None, [
        f"model.cache_dir={tmp_path}", "task.num_train=400", "task.num_eval=16",
        "rollout.rollout_batch_size=4", "rollout.over_sampling_batch_size=8", "rollout.n_samples_per_prompt=4",
        "sampling.max_response_len=24", "engine.max_num_seqs=16", "engine.max_model_len=64",
        "staleness.max_versions=100", "rollout.abort_resend_s=0.5", *extra])


def start_engines(cfg, model_dir, timeout_s=60):
    return EngineGroup.start(cfg, model_dir, plan(cfg), timeout_s=timeout_s)


def start_rollout(cfg, model_dir, engines):
    train_path, _ = dataset_paths(cfg.task, cfg.model.cache_dir)
    return RolloutGroup.start(cfg, model_dir, str(train_path), engines)


def run_steps(cfg, model_dir, engines, num_steps, first_step=0, actors=None):
    actors = actors or start_rollout(cfg, model_dir, engines)
    seen, weights = set(), ray.put(None)
    results = []
    for step in range(first_step, first_step + num_steps):
        result = ray.get(actors.monitor.step.remote(step, step))
        samples = fetch([h for group in result.groups for h in group])  # what a learner rank fetches
        for s in samples:
            assert s.state == SampleState.FINISHED and s.sample_id not in seen
            seen.add(s.sample_id)
            assert len(s.response_ids) == len(s.logprobs) == len(s.versions) <= cfg.sampling.max_response_len
            assert max(s.versions) <= step
        taken = ray.get(actors.source.num_groups_taken.remote())
        counters = ray.get(actors.monitor.state_dict.remote())
        assert taken == counters["returned_groups"] + counters["dropped_groups"] + ray.get(actors.store.size.remote())
        results.append((result, samples))
        ray.get([e.update_weights.remote(weights, step + 1) for e in engines.actors])
    return actors, results


ENGINE_SETS = 4
"""The engine configurations (`engine_key`) of the tests here: each set of engines holds a placement group of
`plan`'s bundles (two engines and a learner's, a CPU each) for the whole module."""


@pytest.fixture(scope="module")
def local_ray():
    # a Ray of its own, never one `ray start` left running; logical CPUs for every shared engine set's
    # bundles at once, and one for the rollout actors (they take a CPU to be placed)
    ray.init(address="local", num_cpus=3 * ENGINE_SETS + 1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def model_dir(random_model_dir):
    return str(random_model_dir)


def engine_key(cfg, model_dir) -> str:
    """What engine actors and their placement (`plan`) are built from (`EngineGroup.start`): tests whose
    configs agree on it can run on the same engines."""
    r = cfg.rollout
    return repr((cfg.engine, cfg.sampling, cfg.staleness, cfg.task, cfg.placement, cfg.learner, cfg.train.output_dir,
                 model_dir, r.episode_fn, r.episode_kwargs, r.tool_timeout_s, r.max_turns, r.max_env_tokens_per_turn))


@pytest.fixture(scope="module")
def engine_sets(local_ray):
    """Engines started by `engine_key`, shared by the module's tests (starting engine processes is most of a
    test's cost), and the model's own weights in the object store by model directory (`as_if_started`)."""
    sets, weights = {}, {}
    yield sets, weights
    for engines in sets.values():
        engines.shutdown()


def as_if_started(shared, initial_weights):
    """Started engines, handed to a test as `EngineGroup.start` leaves them, through their own API: no
    request left running (a test that failed mid-step), no parked KV cache (a version past every parked
    cache's reuse window, staleness.max_versions, expires it), the model's weights at version 0, statistics
    drained, and a group of the test's own (its actor list, restart and skip counters, no weights source).
    The engines' cumulative token counters and sampling streams go on from earlier tests. None when an
    engine is dead (a test killed it for good) or does not answer."""
    status = settle([a.status.remote() for a in shared.actors], timeout_s=120.0)
    if any(isinstance(st, Exception) for st in status):
        return None
    ray.get([a.abort_engine.remote() for a in shared.actors])
    engines = EngineGroup(list(shared.actors), list(shared.capacities), shared.placement_group, shared.layout,
                          incarnations=[st["incarnation"] for st in status], journal=shared.journal,
                          servers_take_weights=shared.servers_take_weights, releases_memory=shared.releases_memory)
    engines.publish(None, max(st["version"] for st in status) + 10 ** 6)
    engines.publish(initial_weights, 0)
    engines.weights = (None, 0)  # as `start` leaves it: the weights the engines loaded
    engines.stats()
    return engines


@pytest.fixture
def engines_of(engine_sets):
    """Engines for a config: those of the module's set for its `engine_key` (started the first time, and
    again after a test killed one for good), as if just started (`as_if_started`); their token counters go on
    from earlier tests."""
    sets, weights = engine_sets

    def start(cfg, model_dir):
        key = engine_key(cfg, model_dir)
        if model_dir not in weights:
            from april_ray.model import load_policy

            weights[model_dir] = ray.put(load_policy(model_dir)[0].state_dict())
        engines = as_if_started(sets[key], weights[model_dir]) if key in sets else None
        if engines is None:
            if key in sets:
                sets.pop(key).shutdown()
            sets[key] = start_engines(cfg, model_dir, timeout_s=60)
            engines = as_if_started(sets[key], weights[model_dir])
        return engines

    return start


class SharedSources:
    """Stands in for `PromptSourceActor` in `RolloutGroup.start`: one source per dataset (by its contents) and
    arguments, set back to its first prompt through its own `load_state_dict` when handed out again (its
    cursor is all of its state: april_ray/rollout/prompt_source.py), and started anew after a test killed it.
    A source reads its dataset and loads the tokenizer once, in a process of its own: most of a rollout's start."""

    def __init__(self, options: dict | None = None, started: dict | None = None):
        self.started = {} if started is None else started
        self.actor_options = options or {}

    def options(self, **options) -> "SharedSources":
        """`PromptSourceActor.options`: the same shared sources, a source started here placed by `options`."""
        return SharedSources(options, self.started)

    def remote(self, data_path, *args):
        key = (hashlib.sha256(Path(data_path).read_bytes()).hexdigest(), repr(args))
        if key in self.started:
            source, first = self.started[key]
            try:
                ray.get(source.load_state_dict.remote(first))
                return source
            except ray.exceptions.RayActorError:
                pass
        source = PromptSourceActor.options(**self.actor_options).remote(data_path, *args)
        self.started[key] = (source, ray.get(source.state_dict.remote()))
        return source


@pytest.fixture(scope="module")
def shared_sources(local_ray):
    return SharedSources()


@pytest.fixture
def rollout_of(shared_sources, monkeypatch):
    """`start_rollout` with the module's prompt sources (`SharedSources`); a test's monitor and store are its
    own, and are stopped after it (so none goes on taking prompts from a shared source)."""
    started = []

    def start(cfg, model_dir, engines):
        with monkeypatch.context() as m:
            m.setattr(driver.rollout, "PromptSourceActor", shared_sources)
            started.append(start_rollout(cfg, model_dir, engines))
        return started[-1]

    yield start
    for actors in started:
        ray.kill(actors.monitor)
        ray.kill(actors.store)


@pytest.mark.parametrize("park", [False, True])
def test_april_steps_on_two_engine_workers(local_ray, tmp_path, model_dir, engines_of, rollout_of, park):
    extra = ["engine.park_slots=32", "engine.reuse_stale_kv=true"] if park else []
    # long responses, so groups finish far apart and some are interrupted (see the killed-engine test)
    cfg = small_cfg(tmp_path, "sampling.max_response_len=200", "engine.max_model_len=256", *extra)
    engines = engines_of(cfg, model_dir)
    before = engines.stats()  # cumulative token counters: this test's are the difference
    # a step interrupts samples, the next resumes them at a newer version: four leave room for that to happen
    actors, results = run_steps(cfg, model_dir, engines, 4, actors=rollout_of(cfg, model_dir, engines))
    resumed = [s for _, samples in results for s in samples if s.num_resumes]
    assert resumed, "some samples should have been interrupted and resumed"
    assert any(len(set(s.versions)) > 1 for s in resumed)
    assert any(r.metrics["rollout/abort_latency_s"] > 0 for r, _ in results)
    assert [st.version for st in engines.stats()] == [4, 4]
    stats = engines.stats()
    assert all(st.num_generated_tokens > b.num_generated_tokens for st, b in zip(stats, before))  # both served
    # with spare slots, resumed samples went back to their engine and restored their parked caches
    assert (sum(st.num_reused_tokens - b.num_reused_tokens for st, b in zip(stats, before)) > 0) == park


def test_sync_baseline_on_ray_stores_nothing(local_ray, tmp_path, model_dir, engines_of, rollout_of):
    cfg = small_cfg(tmp_path, "rollout.schedule=sync", "rollout.over_sampling_batch_size=4")
    engines = engines_of(cfg, model_dir)
    actors, results = run_steps(cfg, model_dir, engines, 2, actors=rollout_of(cfg, model_dir, engines))
    assert ray.get(actors.store.size.remote()) == 0
    assert all(r.metrics["rollout/off_policy_token_ratio"] == 0 for r, _ in results)


def test_checkpoint_store_and_cursor_mid_run_restores_without_loss(local_ray, tmp_path, model_dir, engines_of,
                                                                   rollout_of):
    cfg = small_cfg(tmp_path)
    engines = engines_of(cfg, model_dir)
    actors, first = run_steps(cfg, model_dir, engines, 2, actors=rollout_of(cfg, model_dir, engines))
    saved = (ray.get(actors.source.state_dict.remote()), ray.get(actors.store.state_dict.remote()),
             ray.get(actors.monitor.state_dict.remote()))
    waiting = {g["group_id"] for g in saved[1]["partial"]}
    # the rollout side "crashes": its monitor and store go, and a new one restores from the checkpoint; the
    # (shared) source is handed out again set back to its first prompt (`SharedSources`), so only the saved
    # cursor keeps its prompts from coming back
    ray.kill(actors.monitor)
    ray.kill(actors.store)
    fresh = rollout_of(cfg, model_dir, engines)
    ray.get([fresh.source.load_state_dict.remote(saved[0]), fresh.store.load_state_dict.remote(saved[1]),
             fresh.monitor.load_state_dict.remote(saved[2])])
    _, later = run_steps(cfg, model_dir, engines, 3, first_step=2, actors=fresh)
    before = {s.group_id for _, samples in first for s in samples}
    after = [s.group_id for _, samples in later for s in samples]
    assert not before & set(after)
    state = ray.get(fresh.store.state_dict.remote())
    still = {g["group_id"] for g in state["partial"] + state["complete"]}  # a surplus of the last step waits too
    assert waiting <= set(after) | still  # every stored prompt came back or still waits; none skipped
    # groups stored unscored one way cannot be resumed scored the other way (task.reward_per_group)
    from actors.monitor import CompletionMonitorActor
    other = CompletionMonitorActor.remote(cfg.rollout, cfg.staleness, engines.actors, engines.capacities,
                                          fresh.source, fresh.store, reward_per_group=True)
    with pytest.raises(ray.exceptions.RayTaskError, match="task.reward_per_group=true, but the checkpoint"):
        ray.get(other.load_state_dict.remote(saved[2]))


def partial_groups(store) -> list:
    """The store's partial groups with the engine each last ran on (its JSON state leaves that out): taken
    out and put back, in the same order."""
    groups_ref, samples_ref = store.take_partial.remote(1 << 20, 0)
    groups = with_refs(ray.get(groups_ref), samples_ref)
    ray.get(store.put_partial.remote([Group(g.group_id, g.prompt_index, g.handles, g.created_step, g.engine)
                                      for g in groups]))
    return groups


def test_a_killed_engine_loses_no_sample(local_ray, tmp_path, model_dir, engines_of, rollout_of):
    """An engine actor dies between steps, with partial groups of its own parked in the store: the
    monitor's calls to it fail, those samples go to the surviving engine, and nothing is lost."""
    # Long responses: the random model ends a sample early often enough that groups finish far apart, so
    # some are still generating when the N-th group finishes. At 24 tokens nearly every sample ran to the cap and
    # all groups finished within an engine step or two of each other; under CI's load none was left partial.
    cfg = small_cfg(tmp_path, "engine.park_slots=32", "engine.reuse_stale_kv=true", "sampling.max_response_len=200",
                    "engine.max_model_len=256")
    engines = engines_of(cfg, model_dir)
    actors, stored = rollout_of(cfg, model_dir, engines), []
    for step in range(6):  # which engine's groups are left partial depends on timing: step until some are
        actors, _ = run_steps(cfg, model_dir, engines, 1, first_step=step, actors=actors)
        stored = partial_groups(actors.store)
        if stored:
            break
    assert stored, "some groups should have been left partial in six steps"
    # the caller that takes groups from the store owns their samples (the store's own objects could be freed
    # under a learner that borrows them through the monitor and the driver)
    assert {h.ref.owner_address() for g in stored for h in g.handles} == {ray.put(None).owner_address()}
    victim = max((0, 1), key=lambda e: sum(g.engine == e for g in stored))
    assert any(g.engine == victim for g in stored)
    ray.kill(engines.actors[victim])
    engines.actors = [a for e, a in enumerate(engines.actors) if e != victim]  # weight pushes: survivor only
    actors, results = run_steps(cfg, model_dir, engines, 3, first_step=step + 1, actors=actors)
    assert ray.get(actors.monitor.dead_engines.remote([], -1)) == [victim]  # answers at once: step -1 has ended
    returned = {s.group_id for _, samples in results for s in samples}
    state = ray.get(actors.store.state_dict.remote())
    still = {g["group_id"] for g in state["partial"] + state["complete"]}
    assert {g.group_id for g in stored} <= returned | still


def test_samples_aborted_by_someone_else_mid_step_are_resumed_in_the_same_step(local_ray, tmp_path, model_dir,
                                                                                engines_of, rollout_of):
    """Another caller aborts every request on the engines (no step of the monitor's) while a step runs: the
    monitor re-dispatches the interrupted samples from its handles of their partial results (a sample
    handle is an element of a call's result list, which the engine actor resolves itself), and the
    step still returns N complete groups with nothing lost or repeated."""

    cfg = small_cfg(tmp_path, "sampling.max_response_len=300", "engine.max_model_len=400")
    engines = engines_of(cfg, model_dir)
    actors, _ = run_steps(cfg, model_dir, engines, 1, actors=rollout_of(cfg, model_dir, engines))
    ref = actors.monitor.step.remote(1, 1)
    aborted, hits, i = 0, 0, 0
    while hits < 20 and not ray.wait([ref], timeout=0.005)[0]:  # bounded: each abort costs the step progress,
        # and on a loaded machine unbounded aborts every few ms could keep it from ever finishing
        n = sum(ray.get([e.abort_engine.remote() for e in engines.actors]))
        aborted, hits, i = aborted + n, hits + (n > 0), i + 1
    assert aborted > 0, "the step ended before any external abort hit a running request"
    result = ray.get(ref)
    samples = fetch([h for group in result.groups for h in group])
    assert len(result.groups) == cfg.rollout.rollout_batch_size
    assert all(s.state == SampleState.FINISHED for s in samples) and len({s.sample_id for s in samples}) == len(samples)
    assert any(s.num_resumes for s in samples)
    taken = ray.get(actors.source.num_groups_taken.remote())
    counters = ray.get(actors.monitor.state_dict.remote())
    assert taken == counters["returned_groups"] + counters["dropped_groups"] + ray.get(actors.store.size.remote())


def test_an_engine_sigkilled_mid_step_is_restarted_caught_up_and_the_run_goes_on(local_ray, tmp_path, model_dir,
                                                                                   engines_of, rollout_of):
    """The training loop's rollout (`RolloutGroup.step`) while an engine process is SIGKILLed in the
    middle of a step: the monitor re-dispatches its samples, Ray restarts it in its bundle under the same
    handle, it refuses work until it holds the current weights, the driver catches it up and hands it back,
    and every step completes with nothing lost or repeated."""
    import os
    import signal
    import threading
    import time

    cfg = small_cfg(tmp_path, "sampling.max_response_len=200", "engine.max_model_len=256")
    engines = engines_of(cfg, model_dir)
    actors = rollout_of(cfg, model_dir, engines)
    weights = ray.put(None)  # a version bump only: which version the restarted engine serves is what counts
    victim = 1
    before = ray.get(engines.actors[victim].status.remote())
    seen, crashes, killed = set(), [], []

    def kill_when_busy():
        deadline = time.time() + 60
        while ray.get(engines.actors[victim].stats.remote(False)).num_running == 0 and time.time() < deadline:
            time.sleep(0.005)
        os.kill(before["pid"], signal.SIGKILL)
        killed.append(time.time())

    for step in range(6):
        if step == 1:  # mid-step: the kill lands once the victim runs requests of a step (a step whose
            # batch is all surplus groups carried over from the one before runs nothing, so not always step 1)
            threading.Thread(target=kill_when_busy, daemon=True).start()
        result = actors.step(step, step)
        crashes.append(result.metrics["rollout/engine_crashes"])
        samples = fetch([h for group in result.groups for h in group])
        assert len(result.groups) == cfg.rollout.rollout_batch_size
        for s in samples:
            assert s.state == SampleState.FINISHED and s.sample_id not in seen
            seen.add(s.sample_id)
            assert max(s.versions) <= step
        taken = ray.get(actors.source.num_groups_taken.remote())
        counters = ray.get(actors.monitor.state_dict.remote())
        assert taken == counters["returned_groups"] + counters["dropped_groups"] + ray.get(actors.store.size.remote())
        engines.publish(weights, step + 1)
    assert killed and sum(crashes) == 1, (killed, crashes)  # the kill landed mid-step, and was seen once
    deadline = time.time() + 180  # restarting takes a while on a loaded machine: wait until it is back
    while len(engines.catch_up([0, 1], wait_s=2.0)) < 2 and time.time() < deadline:
        time.sleep(1.0)
    engines.stats()
    actors.step(6, 6)
    after = ray.get(engines.actors[victim].status.remote())
    assert after["pid"] != before["pid"] and after["incarnation"] != before["incarnation"] and engines.restarts == 1
    assert after["serving"] and after["version"] == 6  # caught up to the version published while it was down
    assert ray.get(actors.monitor.dead_engines.remote([], -1)) == []
    assert all(st is not None and st.num_generated_tokens > 0 for st in engines.stats())  # both serve again


def test_a_restarted_engine_is_caught_up_from_the_weights_source_when_weights_went_another_way(
        local_ray, tmp_path, model_dir, engines_of, rollout_of):
    """Under engine.weight_sync broadcast / tensor / disk the servers get the weights directly and the
    publish carries only the version; an engine restarted after that is brought to the current weights
    through the object store, from the learners' `weights_ref`, once for however many restart."""
    import os
    import signal
    import time

    from april_ray.model import load_policy

    cfg = small_cfg(tmp_path)
    engines = engines_of(cfg, model_dir)
    model, _ = load_policy(model_dir)
    current = {k: v + 0.01 for k, v in model.state_dict().items()}  # "version 3", as the learner holds it
    calls = []
    engines.take_weights_from(lambda: calls.append(1) or ray.put(current))
    engines.publish(None, 3)  # the servers got version 3 by broadcast; only the version went this way
    assert engines.catch_up([0, 1], wait_s=30.0) == [0, 1] and not calls  # nobody restarted: nothing to fetch
    victim = ray.get(engines.actors[1].status.remote())
    os.kill(victim["pid"], signal.SIGKILL)
    deadline = time.time() + 180
    while engines.catch_up([0, 1], wait_s=2.0) != [0, 1] and time.time() < deadline:
        time.sleep(1.0)
    after = ray.get(engines.actors[1].status.remote())
    assert after["pid"] != victim["pid"] and after["serving"] and after["version"] == 3
    assert calls == [1] and engines.restarts == 1
    actors, results = run_steps(cfg, model_dir, engines, 1, first_step=3,  # it serves again
                                actors=rollout_of(cfg, model_dir, engines))
    assert results and len(results[0][0].groups) == cfg.rollout.rollout_batch_size


def test_an_engine_restarted_between_steps_is_counted_when_the_publish_reaches_it(local_ray, tmp_path, model_dir,
                                                                                  engines_of):
    """An engine killed while idle and back before the next publish takes the new weights there and serves
    at once, never seen down by a step; its restart is still counted (the `engine/restarts` metric)."""
    import os
    import signal
    import time

    cfg = small_cfg(tmp_path)
    engines = engines_of(cfg, model_dir)
    before = ray.get(engines.actors[0].status.remote())
    os.kill(before["pid"], signal.SIGKILL)
    deadline, after = time.time() + 180, before
    while after["incarnation"] == before["incarnation"] and time.time() < deadline:
        try:
            after = ray.get(engines.actors[0].status.remote(), timeout=5.0)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            time.sleep(0.5)
    assert after["pid"] != before["pid"] and not after["serving"] and engines.restarts == 0
    engines.publish(ray.put(None), 1)
    assert engines.restarts == 1 and ray.get(engines.actors[0].status.remote())["serving"]
    assert engines.catch_up([0, 1], wait_s=10.0) == [0, 1] and engines.restarts == 1  # counted once
