"""What a job computes once at its start and passes down: the policy directory, the dataset files, the
placement plan, and the held-out evaluation items; the start of a training job's output directory, in
the order that keeps another job's files whole (`open_output`); and the job's actors brought up
(`start_run`)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import ray

from april_ray.config import Config, to_yaml
from april_ray.placement import Layout, plan
from april_ray.plugins import check_plugins
from april_ray.task.data import dataset_paths, fit_context, read_examples
from april_ray.task.embedded_model import ensure_model
from april_ray.tracking import truncate_step_logs
from driver.checkpoint import restore_checkpoint
from driver.cluster import init_ray
from driver.engines import EngineGroup
from driver.evaluator import Evaluator
from driver.learners import LearnerGroup
from driver.output_dir import OutputLock, current_run, new_run_id, open_run
from driver.rollout import RolloutGroup


@dataclass(frozen=True)
class JobInputs:
    model_path: str
    train_path: str
    eval_path: str
    layout: Layout


def prepare(cfg: Config) -> JobInputs:
    """Build (or reuse) the embedded model and task data, and plan the placement group. A plug-in that does
    not import or has the wrong signature stops the job here, naming its key, before any actor starts."""
    check_plugins(cfg)
    model_path = ensure_model(cfg)
    train_path, eval_path = dataset_paths(cfg.task, cfg.model.cache_dir)
    check_data(cfg, model_path, train_path, eval_path)
    return JobInputs(str(Path(model_path)), str(train_path), str(eval_path), plan(cfg))


def check_data(cfg: Config, model_path, train_path, eval_path) -> None:
    """Read every dataset of the job as its readers will (the prompt source actor, the evaluator) and fit
    its prompts to the context, so a bad row stops the job here, named by file and line, before Ray starts
    (in an actor it would be a dead actor's traceback)."""
    from april_ray.task.chat import PromptEncoder
    from april_ray.task.tokenizer import load_tokenizer

    tok = load_tokenizer(model_path)
    encode = PromptEncoder(tok, cfg.task, f"the tokenizer of {model_path}")
    budget = cfg.engine.max_model_len - cfg.sampling.max_response_len
    task = cfg.task
    sets = [(train_path, task.prompt_key, task.answer_key, "task.train_path", tok.unk_token_id),
            (eval_path, task.prompt_key, task.answer_key, "task.eval_path", None)]
    sets += [(d.path, d.prompt_key, d.answer_key, f"eval.datasets.{name}.path", None)
             for name, d in cfg.eval.datasets.items()]
    for path, prompt_key, answer_key, key, unk_id in sets:
        try:
            examples = read_examples(path, prompt_key, answer_key, task.metadata_keys)
        except FileNotFoundError as e:
            raise ValueError(f"{key}: {e}") from None
        fit_context(examples, encode, budget, task.overlong_prompts, "task.overlong_prompts", lambda _: None, unk_id)


@dataclass
class Output:
    """A training job's output directory, held for it alone (`lock`), with its run opened."""
    path: Path
    lock: OutputLock
    inputs: JobInputs
    checkpoint: Path | None
    """The checkpoint to resume from (None: step 0)."""


def open_output(cfg: Config) -> Output:
    """Take train.output_dir for this job (a second job there stops at once, naming this one), then check
    the model, the data and the placement (`prepare`), and only then open the run there: move an earlier
    run aside, or find the checkpoint to resume from. A job that fails a check has moved nothing."""
    out = Path(cfg.train.output_dir)
    run = None if cfg.train.resume else new_run_id()
    lock = OutputLock(out, run or current_run(out))
    try:
        inputs = prepare(cfg)
        ckpt = open_run(out, cfg.train, new_run=run)
        lock.name_run(current_run(out))
        (out / "config.yaml").write_text(to_yaml(cfg))
    except BaseException:
        lock.release()
        raise
    return Output(out, lock, inputs, ckpt)


@dataclass
class Run:
    """A job's actors and where it writes, as `start_run` brings them up (`driver/restore.py` replaces the
    rollout and the learners when one of them dies)."""
    out: Path
    inputs: JobInputs
    engines: EngineGroup
    rollout: RolloutGroup
    learners: LearnerGroup
    evaluator: Evaluator
    start: int    # the first step to run
    version: int  # the policy version the engines serve
    resumed: bool
    lock: OutputLock  # train.output_dir, this job's alone until it ends

    def shutdown(self) -> None:
        for actors in (self.rollout, self.engines, self.learners):
            actors.shutdown()
        self.lock.release()


def start_run(cfg: Config) -> Run:
    """Bring the job's actors up. A fresh run first moves an earlier run's files to runs/; a resumed run
    restores its newest checkpoint and drops the step rows logged after it (those steps are redone)."""
    output = open_output(cfg)  # held for this job alone; model, data and plan checked before a file moves
    out, job, ckpt = output.path, output.inputs, output.checkpoint
    if not ray.is_initialized():
        init_ray(job.layout, cfg.logging)

    # The engines load while the prompt source reads the dataset and the learner ranks set up, unless they
    # share GPUs: an engine sizes its KV cache from the memory free when it loads.
    engines = EngineGroup.start(cfg, job.model_path, job.layout, wait=job.layout.colocated)
    rollout = RolloutGroup.start(cfg, job.model_path, job.train_path, engines)
    learners = LearnerGroup(cfg, job.model_path, engines)
    engines.wait_loaded()
    engines.take_weights_from(learners.weights_ref)  # how a restarted engine is caught up
    evaluator = Evaluator(cfg, engines, job.model_path, job.eval_path)
    start, version = 0, 0
    if ckpt is not None:
        start, version = restore_checkpoint(ckpt, learners, rollout, engines)
        print(f"resumed from {ckpt}: step {start}, policy version {version}")
    if cfg.train.resume:
        truncate_step_logs(out, start - 1)
    return Run(out, job, engines, rollout, learners, evaluator, start, version, resumed=ckpt is not None,
               lock=output.lock)
