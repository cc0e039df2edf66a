"""What a job computes once at its start and passes down: the policy directory, the dataset files, the
placement plan, and the held-out evaluation items; and the start of a training job's output directory, in
the order that keeps another job's files whole (`open_output`)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from april_ray.config import Config, to_yaml
from april_ray.placement import Layout, plan
from april_ray.plugins import check_plugins
from april_ray.task.data import dataset_paths, fit_context, read_examples
from april_ray.task.embedded_model import ensure_model
from driver.output_dir import OutputLock, current_run, new_run_id, open_run


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
    from transformers import AutoTokenizer

    from april_ray.task.chat import PromptEncoder

    tok = AutoTokenizer.from_pretrained(model_path)
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
