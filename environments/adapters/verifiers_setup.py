"""How the verifiers adapter (environments/adapters/verifiers.py) sets verifiers up on this machine:
plugin ids for module paths, the EnvConfig with local harnesses and runtimes, and the chat program
verifiers would `uv sync`, provisioned on this interpreter instead."""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
import sys
import uuid
from pathlib import Path
from typing import Any

import verifiers.v1 as vf
from packaging.requirements import Requirement
from verifiers.v1.configs.agent import agent_config_fields
from verifiers.v1.harnesses.null import NullHarnessConfig
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM, CHAT_PROGRAM_SOURCE
from verifiers.v1.runtimes import SubprocessConfig, SubprocessRuntime


def plugin_id(value: str, importer) -> str:
    """The id verifiers imports `value` by: an installed plugin's id as given, or a dotted module
    path registered under its last name (verifiers 0.4 imports ids as top-level modules only)."""
    parts = value.split(".")
    if len(parts) == 1 or not all(part.isidentifier() for part in parts):
        return value
    module, alias = importlib.import_module(value), parts[-1]
    taken = alias in sys.modules
    sys.modules.setdefault(alias, module)
    if sys.modules[alias] is not module or importer(alias) is not module:
        if not taken:
            del sys.modules[alias]
        raise ValueError(f"{value}: verifiers would import {alias!r} as another module; give the module another name")
    return alias


def local_env_config(block: dict[str, Any]) -> vf.EnvConfig:
    """The verifiers EnvConfig of `block`, every agent without a harness of its taskset's own on the
    null harness and every agent without a runtime on the subprocess runtime."""
    block = dict(block)
    taskset = dict(block.get("taskset") or {})
    if not taskset.get("id"):
        raise ValueError("env.taskset.id is required: an installed verifiers taskset id or a module path")
    taskset["id"] = plugin_id(taskset["id"], vf.import_taskset)
    if block.get("id"):
        block["id"] = plugin_id(block["id"], vf.import_environment)
    config = vf.resolve_env_config({**block, "taskset": taskset})
    bundled_harness = vf.default_harness_id(taskset["id"]) != "bash"
    for name, agent in agent_config_fields(config).items():
        local: dict[str, Any] = {}
        if agent.harness is None and not bundled_harness:
            local["harness"] = NullHarnessConfig(id="null")
        if "runtime" not in agent.model_fields_set:
            local["runtime"] = SubprocessConfig()
        config = config.model_copy(update={name: agent.model_copy(update=local)})
    return config


def provision_chat_program() -> None:
    """Makes the null (and bash) harness's chat program run on this interpreter, as if verifiers
    had `uv sync`ed it: the script at the path SubprocessRuntime.prepare_uv_script keys its
    environments by, this interpreter recorded as that environment's."""
    header = next(line for line in CHAT_PROGRAM.splitlines() if line.startswith("# dependencies"))
    for requirement in map(Requirement, json.loads(header.partition("=")[2])):
        try:
            installed = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        if installed is None or not requirement.specifier.contains(installed, prereleases=True):
            raise RuntimeError(
                f"verifiers' chat program needs {requirement} and this environment has {installed or 'none'}; "
                "install requirements/env-verifiers.lock (make .venv-env-verifiers/.installed)"
            )
    script = CHAT_PROGRAM_SOURCE.encode()
    path = f"{SubprocessRuntime.scripts_dir}/{hashlib.sha256(script).hexdigest()}.py"
    target = Path(path)
    if not target.exists() or target.read_bytes() != script:
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{uuid.uuid4().hex}.tmp")
        partial.write_bytes(script)
        partial.replace(target)
    SubprocessRuntime._interpreters[path] = sys.executable
