"""Plug-in points loaded by dotted path (`module:attribute`): reward, group reward, episode and agent functions.

`check_plugins` imports each one the config names and checks its signature in the driver, before Ray
starts, so that a missing module, a misspelt name or an episode written as a plain `def` stops the job
with one line naming the key and the file, not an actor's traceback seconds later. `in_thread` is how a
user's plain function (a reward, a tool) runs without holding up an engine's event loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import threading

from april_ray.errors import ConfigError


def load_object(path: str, key: str):
    """The callable `path` names (`package.module:name`, the module imported from sys.path); a ValueError
    names the config `key` and what failed."""
    module_name, _, name = path.partition(":")
    if not module_name or not name:
        raise ValueError(f"{key}: expected module:function, got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{key}: cannot import {module_name!r} ({e}); is its directory on PYTHONPATH "
                         "(for a Ray job, in its runtime_env)?") from e
    except Exception as e:  # the module itself fails as it is imported
        raise ValueError(f"{key}: importing {module_name!r} raised {e!r}") from e
    obj = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{key}: module {module_name!r} ({module.__file__}) has no {name!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{key}: {path!r} is a {type(obj).__name__}, not a function")
    return obj


def is_async(fn) -> bool:
    """An `async def` function, or an object whose `__call__` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def accepts(fn, *args, **kwargs) -> bool:
    """Whether `fn` can be called with these arguments (a function without a readable signature can)."""
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError:
        return False
    except ValueError:  # no signature to read (some builtins)
        return True
    return True


def takes_keyword(fn, name: str) -> bool:
    """Whether `fn` names a parameter `name` that can be passed by keyword (`**kwargs` alone does not)."""
    try:
        param = inspect.signature(fn).parameters.get(name)
    except (TypeError, ValueError):
        return False
    return param is not None and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)


def where(fn) -> str:
    """The file that defines `fn`, for an error message."""
    with contextlib.suppress(TypeError):
        return inspect.getsourcefile(inspect.unwrap(fn)) or "?"
    with contextlib.suppress(TypeError):
        return inspect.getsourcefile(type(fn)) or "?"
    return "?"


def check_reward_fn(fn, key: str, per_group: bool = False) -> None:
    """A reward, per sample or per group: callable with (prompt, response, answer[, metadata]) or their
    lists, plain or async."""
    if not accepts(fn, *range(4)) and not accepts(fn, *range(3)):
        args = "prompts, responses, answers[, metadatas]" if per_group else "prompt, response, answer[, metadata]"
        raise ValueError(f"{key}: {getattr(fn, '__qualname__', fn)}{_signature(fn)} in {where(fn)} cannot be "
                         f"called with ({args})")


def check_episode_fn(fn, key: str, kwargs: dict) -> None:
    """An episode: an `async def` of the handle (and the `rollout.episode_kwargs`)."""
    name = f"{getattr(fn, '__qualname__', fn)}{_signature(fn)} in {where(fn)}"
    if not is_async(fn):
        raise ValueError(f"{key}: {name} is a plain function; an episode must be `async def` "
                         "(it awaits ep.generate)")
    if not accepts(fn, object(), **kwargs):
        extra = f" and the keywords {sorted(kwargs)} of rollout.episode_kwargs" if kwargs else ""
        raise ValueError(f"{key}: {name} cannot be called with the episode handle{extra}")


def check_agent_fn(fn, key: str, kwargs: dict) -> None:
    """An agent: an `async def` of (base_url, api_key, row) and the `rollout.agent_kwargs`."""
    name = f"{getattr(fn, '__qualname__', fn)}{_signature(fn)} in {where(fn)}"
    if not is_async(fn):
        raise ValueError(f"{key}: {name} is a plain function; an agent must be `async def` "
                         "(it awaits the endpoint)")
    if not accepts(fn, "http://127.0.0.1:1/v1", "key", {}, **kwargs):
        extra = f" and the keywords {sorted(kwargs)} of rollout.agent_kwargs" if kwargs else ""
        raise ValueError(f"{key}: {name} cannot be called with (base_url, api_key, row){extra}")


def _signature(fn) -> str:
    with contextlib.suppress(TypeError, ValueError):
        return str(inspect.signature(fn))
    return "(...)"


def check_plugins(cfg) -> None:
    """Import every plug-in the config names and check its signature; a ConfigError names the key, the
    file and what is wrong."""
    try:
        if cfg.task.reward_fn:
            fn = load_object(cfg.task.reward_fn, "task.reward_fn")
            check_reward_fn(fn, "task.reward_fn", cfg.task.reward_per_group)
        if cfg.rollout.episode_fn:
            check_episode_fn(load_object(cfg.rollout.episode_fn, "rollout.episode_fn"), "rollout.episode_fn",
                             dict(cfg.rollout.episode_kwargs))
        if cfg.rollout.agent_fn:
            check_agent_fn(load_object(cfg.rollout.agent_fn, "rollout.agent_fn"), "rollout.agent_fn",
                           dict(cfg.rollout.agent_kwargs))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def in_thread(fn, *args, **kwargs) -> asyncio.Future:
    """`fn(*args, **kwargs)` in a daemon thread of its own: a future of the running loop that settles with
    its value or its exception. The loop never waits for it, and a timeout on the future measures that
    call alone (no queueing behind a slow one, as in a pool). A thread cannot be stopped: a call that
    never returns keeps its thread, which is never joined at exit."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def run() -> None:
        try:
            out = (True, fn(*args, **kwargs))
        except Exception as e:
            out = (False, e)
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(_settle, fut, out)

    threading.Thread(target=run, daemon=True, name=getattr(fn, "__name__", "plugin")).start()
    return fut


def _settle(fut: asyncio.Future, out) -> None:
    if fut.done():  # timed out and cancelled
        return
    ok, value = out
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)
