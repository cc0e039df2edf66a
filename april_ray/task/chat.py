"""Prompt ids: a dataset row's prompt through the tokenizer's chat template, or its text encoded as is.

Every path that turns a dataset row's prompt into ids (the prompt source, the context check, evaluation)
goes through one `PromptEncoder`, so training and evaluation see the same ids. The embedded model's
warm-up encodes the countdown's prompts as text, which the embedded template renders unchanged
(tests/test_chat_template.py checks both give the same ids).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from april_ray.config import TaskConfig


class PromptEncoder:
    """`task.apply_chat_template`: auto (the template when the tokenizer has one), true (it must have
    one), false (the text as is; a chat row's user turns joined by newlines, as `Example.prompt`)."""

    def __init__(self, tokenizer, task: TaskConfig, where: str = "the tokenizer"):
        mode = str(task.apply_chat_template).lower()
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if mode == "true" and not has_template:
            raise ValueError(f"task.apply_chat_template=true: {where} has no chat template "
                             f"(set it to auto or false, or use a tokenizer with one)")
        self.tokenizer = tokenizer
        self.use_template = has_template and mode != "false"
        self.kwargs = dict(task.chat_template_kwargs)
        if self.kwargs and not self.use_template:  # they would be ignored without a word
            raise ValueError(f"task.chat_template_kwargs: set ({sorted(self.kwargs)}), but no chat template is "
                             f"applied (task.apply_chat_template={task.apply_chat_template}; "
                             f"{where} {'has one' if has_template else 'has none'})")

    def __call__(self, prompt: str | list[dict]) -> list[int]:
        """Ids of a row's prompt as given (`Example.as_given`): a string is one user message."""
        if not self.use_template:
            return self.tokenizer.encode(prompt if isinstance(prompt, str) else _user_text(prompt))
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False, **self.kwargs))


def _user_text(messages) -> str:
    return "\n".join(m["content"] for m in messages if m.get("role", "user") == "user")
