"""Loading what a config names by import path: 'package.module:name', or 'path/to/file.py:name' for
a file as it is (an upstream environment beside its sibling modules). One loader for every such
field (environments, adapters' classes and hooks, losses, trackers), so each says what is wrong
the same way: the field, the path, the fix."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any


def import_module_at(where: str):
    """A module by its import path ('package.module'), or a Python file by its path ('dir/env.py'):
    loaded as if run as a script in its directory (its directory first on sys.path), so the
    sibling modules it imports resolve, as they do for an upstream environment run the way its
    README says (`python regex_env.py serve`). ImportError, naming what is missing, otherwise."""
    if not where.endswith(".py"):
        return importlib.import_module(where)
    file = Path(where).expanduser().resolve()
    if not file.is_file():
        raise ImportError(f"no file {file}")
    if str(file.parent) not in sys.path:
        sys.path.insert(0, str(file.parent))
    name = file.stem
    if getattr(sys.modules.get(name), "__file__", None) == str(file):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"{file}: not a Python module that can be loaded")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: dataclasses and pickling look their module up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def load_attribute(path: str, field: str, error: type[ValueError] = ValueError) -> Any:
    """The object `path` ('module.path:name' or 'path/to/file.py:name') names, for the config field
    `field`; `error` (a ValueError) naming the field, the path and the fix when it cannot be had."""
    module_name, _, name = path.rpartition(":")
    if not module_name or not name:
        raise error(f"{field}: {path!r}: use 'package.module:name' or 'path/to/file.py:name'")
    try:
        module = import_module_at(module_name)
    except ImportError as failure:
        raise error(
            f"{field}: {path!r}: cannot import {module_name} ({failure}); check the spelling and that it is "
            "installed or importable from the working directory"
        ) from failure
    if not hasattr(module, name):
        raise error(f"{field}: {path!r}: {module_name} has no {name!r}; name one defined there")
    return getattr(module, name)
