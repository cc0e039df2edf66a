"""An example environment for agent RL on math: a calculator the model calls inside its reasoning.

    rollout.episode_fn: april_ray.task.calculator:episode

The model writes `<calc>2*(3+4)</calc>`; the environment answers `<result>14</result>` (environment tokens:
context, not trained) and the model goes on. An episode ends at a turn without a call, after `MAX_CALLS`
calls, or at the budget; the task's reward (math-verify on the final answer) scores the whole response.
Expressions are evaluated on their syntax tree (numbers, + - * / // % **, parentheses): nothing a model
writes is ever executed as code. No network is needed.
"""
from __future__ import annotations

import ast
import operator
import re

MAX_CALLS = 8
CALL = re.compile(r"<calc>(.*?)</calc>\s*$", re.DOTALL)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression as text, or an error message the model can read."""
    try:
        value = _value(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError) as e:
        return f"error: {type(e).__name__}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 10) if isinstance(value, float) else value)


def _value(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.operand))
    raise ValueError(f"not arithmetic: {type(node).__name__}")


async def episode(ep) -> None:
    """Model turns, each ending at `</calc>` (a call, answered) or at the end of the response."""
    while True:
        text = await ep.generate(stop=("</calc>",))
        call = CALL.search(text)
        if call is None or ep.state.get("calls", 0) >= MAX_CALLS:
            return None
        ep.state["calls"] = ep.state.get("calls", 0) + 1
        result = await ep.call_tool("calculator", calculate, call.group(1))
        ep.append_env(f"<result>{result}</result>")
