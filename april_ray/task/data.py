"""Prompt datasets: JSONL or Parquet rows with a prompt field and an answer field.

This is the layout of DAPO-Math-17k and DeepScaleR, and the countdown generator writes the same layout,
so the embedded task and real data go through one path. Errors name the file and the line (or row).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from april_ray.task.countdown import write_jsonl
from april_ray.task.registry import get_task

if TYPE_CHECKING:
    from april_ray.config import TaskConfig


@dataclass(frozen=True)
class Example:
    index: int
    """Row number in the dataset file (0-based); the prompt source's cursor counts these."""
    prompt: str
    """The prompt as text: a chat row's user turns joined by newlines (what rewards and logs see)."""
    answer: str
    where: str = ""
    """`file:line` (JSONL) or `file: row i` (Parquet), for errors about this row."""
    messages: tuple = ()
    """A chat row's messages ({role, content}, system turns included) as the chat template gets them;
    empty for a string prompt (one user message)."""
    metadata: dict = field(default_factory=dict)
    """The row's other fields (JSON values), handed to reward and episode functions."""

    @property
    def as_given(self) -> str | list[dict]:
        """The prompt as the row gave it, for `PromptEncoder`: its text, or its list of messages."""
        return list(self.messages) if self.messages else self.prompt


def _messages(value: list, where: str, key: str) -> tuple:
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: field {key!r}[{i}]: expected a message with a string 'content'")
        if not isinstance(m.get("role", "user"), str):
            raise ValueError(f"{where}: field {key!r}[{i}]: 'role' must be a string")
    return tuple({"role": m.get("role", "user"), "content": m["content"]} for m in value)


def _text(value, where: str, key: str) -> str:
    if isinstance(value, list):  # chat layout (DAPO-Math-17k): the user turns' content
        value = "\n".join(m["content"] for m in _messages(value, where, key) if m["role"] == "user")
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: field {key!r} must be a non-empty string (or a list of chat messages), "
                         f"got {type(value).__name__} {value!r:.60}")
    return value


def _answer(value, where: str, key: str) -> str:
    if isinstance(value, dict) and "ground_truth" in value:  # reward_model layout
        value = value["ground_truth"]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: field {key!r} must be a non-empty string or a number "
                         f"(or {{'ground_truth': ...}}), got {type(value).__name__} {value!r:.60}")
    return value


def _check_row(row, where: str, prompt_key: str, answer_key: str, index: int,
               metadata_keys: list[str] | None = None) -> Example:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected an object with fields {prompt_key!r} and {answer_key!r}, "
                         f"got {type(row).__name__}")
    for key in (prompt_key, answer_key):
        if row.get(key) is None:
            raise ValueError(f"{where}: missing field {key!r} (fields: {sorted(row)[:10]})")
    prompt = row[prompt_key]
    messages = _messages(prompt, where, prompt_key) if isinstance(prompt, list) else ()
    metadata = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)
                and (metadata_keys is None or k in metadata_keys)}
    return Example(index, _text(prompt, where, prompt_key), _answer(row[answer_key], where, answer_key), where,
                   messages, _json_values(metadata, where))


def _json_values(metadata: dict, where: str) -> dict:
    """The row's other fields as JSON values (Parquet gives numpy and datetime types): they travel with
    the sample into the store's JSON and checkpoints."""
    try:
        return json.loads(json.dumps(metadata, default=_plain))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: a field other than the prompt and answer is not a JSON value ({e})") from None


def _plain(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "isoformat"):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} {value!r:.60}")


def _jsonl_rows(path: Path):
    """(line number, text) of each row. UTF-8 with or without a byte-order mark, LF or CRLF line ends;
    blank lines after the last row are allowed, a blank line before or between rows is an error."""
    blank, rows = None, 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column "
                                 f"{e.start + 1})") from None
            if not line.strip():
                blank = blank or lineno
                continue
            if blank is not None:
                where = "between rows" if rows else "before the first row"
                raise ValueError(f"{path}:{blank}: empty row (a blank line {where})")
            rows += 1
            yield lineno, line


def read_examples(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer",
                  metadata_keys: list[str] | None = None) -> list[Example]:
    """Every row of a JSONL or Parquet file; a bad row raises a ValueError naming the file and line (row).
    `metadata_keys`: the other fields kept as each example's metadata (None: all)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset not found: {path}")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
        examples = [_check_row(r, f"{path}: row {i}", prompt_key, answer_key, i, metadata_keys)
                    for i, r in enumerate(rows)]
    else:
        examples = []
        for lineno, line in _jsonl_rows(path):
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            examples.append(_check_row(row, where, prompt_key, answer_key, len(examples), metadata_keys))
    if not examples:
        raise ValueError(f"{path}: no examples")
    return examples


def fit_context(examples: list[Example], encode, max_prompt_tokens: int, policy: str, key: str,
                log=print, unk_id: int | None = None) -> list[Example]:
    """The examples whose prompt leaves the full response budget in the engine's context: at most
    `max_prompt_tokens` (engine.max_model_len - sampling.max_response_len) tokens. `policy` (the config's
    task.overlong_prompts) `fail`: a ValueError naming the first long row and the key to change; `skip`:
    drop them and warn with their count and first rows (each keeps its `index`, so the cursor of a
    checkpoint taken on the same file and config stays valid). A prompt the tokenizer encodes with its
    unknown token `unk_id` is a ValueError naming the row and the characters (the policy would not see them)."""
    kept, long = [], []
    for ex in examples:
        ids = encode(ex.as_given)
        if unk_id is not None and unk_id in ids:
            unknown = sorted({c for c in ex.prompt if unk_id in encode(c)})
            raise ValueError(f"{ex.where}: prompt has characters the tokenizer does not know ({''.join(unknown)[:20]!r}): "
                             f"they would become its unknown token; use a tokenizer that has them, or clean the data")
        n = len(ids)
        (long if n > max_prompt_tokens else kept).append((ex, n))
    if not long:
        return examples
    first = ", ".join(f"{ex.where} ({n} tokens)" for ex, n in long[:3])
    if policy == "fail":
        raise ValueError(f"{first}: prompt longer than the {max_prompt_tokens} tokens engine.max_model_len - "
                         f"sampling.max_response_len leaves ({len(long)} such rows); raise engine.max_model_len "
                         f"or set {key}=skip")
    log(f"warning: {key}=skip: skipped {len(long)} of {len(examples)} prompts longer than {max_prompt_tokens} "
        f"tokens: {first}{' ...' if len(long) > 3 else ''}")
    if not kept:
        raise ValueError(f"{first}: every prompt of the dataset is longer than {max_prompt_tokens} tokens; "
                         f"raise engine.max_model_len")
    return [ex for ex, _ in kept]


def dataset_paths(cfg: TaskConfig, cache_dir: str) -> tuple[Path, Path]:
    """(train, eval) files: the configured ones, or the task's own generated once into the cache."""
    if cfg.train_path:
        return Path(cfg.train_path), Path(cfg.eval_path or cfg.train_path)
    task = get_task(cfg.name)
    out = task.data_dir(cfg, cache_dir)
    train, evaluation = out / "train.jsonl", out / "eval.jsonl"
    if not (train.is_file() and evaluation.is_file()):
        write_jsonl(task.generate(cfg, cfg.num_train, cfg.seed), train)
        write_jsonl(task.generate(cfg, cfg.num_eval, cfg.seed + 1), evaluation)
    return train, evaluation
