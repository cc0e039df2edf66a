"""OpenAI's chat-completions wire format for the agent endpoint (agent_endpoint.py): requests checked into
what the endpoint needs, errors in OpenAI's shape, a model turn's text parsed into `tool_calls`, and the
response body.

Tool calls are parsed in one of two formats, chosen once per tokenizer (`tool_call_parser`): Qwen3's
`<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks (the format SGLang's Qwen parser reads),
or the embedded model's, where a turn that ends with `?` calls the request's first tool with no arguments
(its one tool, whose answer is the next key's value). A turn no parser fits is returned as plain content.
The content returned is what renders back to the sampled tokens through the model's chat template: the
embedded template renders an assistant turn's content alone, so there the call's `?` stays in it.
"""
from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any, Callable

MODEL = "policy"
"""The one model the endpoint serves (`GET /v1/models`): the policy being trained."""
MAX_BODY = 4 << 20
"""A request body's bytes at most (a longer one is refused with 413)."""
ROLES = ("system", "user", "assistant", "tool", "developer")


class RequestError(Exception):
    """A request the endpoint refuses: its HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """What the endpoint uses of a `/v1/chat/completions` body; sampling settings are the job's own (the
    behaviour policy is what trains), so `temperature` and the like are accepted and ignored."""

    messages: list[dict]
    tools: list[dict] | None
    stop: tuple[str, ...]
    logprobs: bool


def parse_request(raw: bytes) -> ChatRequest:
    """The request in `raw`, or a RequestError naming the field at fault."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(400, f"the request body is not JSON ({e})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    if "model" not in body:
        raise RequestError(400, "model: required", param="model")
    if body["model"] != MODEL:
        raise RequestError(404, f"the model {body.get('model')!r} does not exist; this endpoint serves {MODEL!r}",
                           param="model", code="model_not_found")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages: expected a non-empty list of messages", param="messages")
    messages = [_checked_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(_tool_name(t) for t in tools)):
        raise RequestError(400, "tools: expected a list of {type: function, function: {name, ...}}", param="tools")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not (isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop)):
        raise RequestError(400, "stop: expected a string or a list of strings", param="stop")
    return ChatRequest(messages, tools or None, tuple(stop), bool(body.get("logprobs")))


def parse_journal(raw: bytes) -> tuple[str, tuple | None]:
    """A journal request (`POST /v1/april/journal`): (the call's idempotency key, (its result,) to record, or
    None to read what is recorded), or a RequestError naming the field at fault."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(400, f"the request body is not JSON ({e})", code="invalid_json") from None
    if not isinstance(body, dict) or not isinstance(body.get("key"), str) or not body["key"]:
        raise RequestError(400, "key: expected a call's idempotency key (a string)", param="key")
    return body["key"], (body["value"],) if "value" in body else None


def _checked_message(m: Any, where: str) -> dict:
    """The message, its content as one string (a list of text parts joined, as OpenAI's API allows)."""
    if not isinstance(m, dict) or m.get("role") not in ROLES:
        raise RequestError(400, f"{where}: expected an object with a role in {ROLES}", param=where)
    content = m.get("content")
    if content is None and m["role"] == "assistant" and m.get("tool_calls"):
        return m
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return dict(m, content="".join(p["text"] for p in content))
    if not isinstance(content, str):
        raise RequestError(400, f"{where}.content: expected a string or a list of text parts",
                           param=f"{where}.content")
    return m


def _tool_name(tool: Any) -> str | None:
    fn = tool.get("function") if isinstance(tool, dict) else None
    return fn.get("name") if isinstance(fn, dict) and isinstance(fn.get("name"), str) else None


def for_template(messages: list[dict]) -> list[dict]:
    """The messages as chat templates read them: None content (an assistant turn of tool calls alone) as ""
    (a tool call's `arguments` stay the text the model wrote: a template renders a string as is)."""
    return [dict(m, content=m.get("content") or "") for m in messages]


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def qwen3_tool_calls(text: str, tools: list[dict] | None) -> tuple[str | None, list[dict]]:
    """Qwen3's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks: (the text outside them, the
    calls); any block that is not such JSON leaves the whole text as content, with no calls."""
    blocks = TOOL_CALL.findall(text)
    if not blocks:
        return text, []
    calls = []
    for block in blocks:
        try:
            obj = json.loads(block)
        except ValueError:
            return text, []
        if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
            return text, []
        args = obj.get("arguments", {})
        calls.append(_call(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
    content = TOOL_CALL.sub("", text).strip()
    return content or None, calls


def bare_tool_calls(text: str, tools: list[dict] | None) -> tuple[str | None, list[dict]]:
    """The embedded model's: a turn ending with `?` calls the request's first tool, without arguments; the
    text stays the content (the embedded template renders it alone)."""
    if tools and text.rstrip().endswith("?"):
        return text, [_call(_tool_name(tools[0]), "{}")]
    return text, []


def tool_call_parser(tokenizer) -> Callable[[str, list[dict] | None], tuple[str | None, list[dict]]]:
    """Qwen3's parser for a tokenizer that has the `<tool_call>` token, the embedded model's otherwise."""
    return qwen3_tool_calls if "<tool_call>" in tokenizer.get_vocab() else bare_tool_calls


def completion(calls: list[dict], content: str | None, finish: str, num_prompt: int,
               token_ids: list[int], logprobs: list[float] | None, pieces: list[str]) -> dict:
    """The response body: one choice with the assistant message, `usage`, and per-token logprobs when asked
    (`token_ids` too, an extension: the exact tokens, as SGLang returns them)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": "tool_calls" if calls else finish,
                              "logprobs": None}
    if logprobs is not None:
        choice["logprobs"] = {"content": [{"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                                          for p, lp in zip(pieces, logprobs)]}
    return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "model": MODEL,
            "choices": [choice], "token_ids": token_ids,
            "usage": {"prompt_tokens": num_prompt, "completion_tokens": len(token_ids),
                      "total_tokens": num_prompt + len(token_ids)}}
