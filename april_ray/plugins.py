"""Plug-in points loaded by dotted path (`module:attribute`): reward and episode functions."""
from __future__ import annotations

import importlib


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
    obj = module
    for part in name.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{key}: module {module_name!r} ({module.__file__}) has no {name!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{key}: {path!r} is a {type(obj).__name__}, not a function")
    return obj
