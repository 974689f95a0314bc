"""Finding environments: by import path ('module:Class') or by the name an installed package gives
them in the `clotho.environments` entry-point group; checked when loaded, before anything samples."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from pydantic import ValidationError

from core.imports import load_attribute
from core.validation import describe_validation_error
from environments.base import Environment, EnvironmentConfig, EnvironmentLoadError, Item
from environments.failures import fetch_failed
from storage.layout import check_env_name

ENTRY_POINT_GROUP = "clotho.environments"
BUNDLED = "environments.bundled"  # the bundled environments' package (before: environments.NAME)


@dataclass(frozen=True)
class Installed:
    """One environment an installed distribution declares (clotho's bundled ones included)."""

    name: str
    import_path: str
    distribution: str


def installed_environments() -> list[Installed]:
    """Every `clotho.environments` entry point of the installed distributions, sorted by name."""
    found = []
    for point in entry_points(group=ENTRY_POINT_GROUP):
        distribution = point.dist.name if point.dist is not None else "?"
        found.append(Installed(point.name, point.value, distribution))
    return sorted(found, key=lambda installed: installed.name)


def resolve_import_path(name_or_path: str) -> str:
    """'module.path:Class' as given, or the import path an installed package declares for a name."""
    if ":" in name_or_path:
        return name_or_path
    matches = [installed for installed in installed_environments() if installed.name == name_or_path]
    if not matches:
        known = ", ".join(installed.name for installed in installed_environments()) or "none"
        raise EnvironmentLoadError(
            f"environment {name_or_path!r}: no installed environment has that name (installed: {known}); "
            "give an import path 'module.path:ClassName' or pip install the package that provides it"
        )
    if len({m.import_path for m in matches}) > 1:
        where = ", ".join(f"{m.import_path} ({m.distribution})" for m in matches)
        raise EnvironmentLoadError(
            f"environment {name_or_path!r}: several installed packages declare it ({where}); use an import path"
        )
    return matches[0].import_path


def load_environment_class(name_or_path: str) -> type[Environment]:
    """The Environment subclass for an installed name, 'module.path:ClassName' (or
    'path/to/file.py:ClassName') or the URL of a
    `clotho env serve` service (environments/remote.py), its name checked."""
    if name_or_path.startswith(("http://", "https://")):
        from environments.remote import remote_environment_class

        return remote_environment_class(name_or_path)
    import_path = resolve_import_path(name_or_path)
    try:
        cls = load_attribute(import_path, "environment", EnvironmentLoadError)
    except EnvironmentLoadError as error:
        module_name, _, class_name = import_path.partition(":")
        package, _, leaf = module_name.rpartition(".")
        if package == "environments" and importlib.util.find_spec(f"{BUNDLED}.{leaf}") is not None:
            raise EnvironmentLoadError(
                f"{error}; the bundled environments are in {BUNDLED}: use "
                f"'{BUNDLED}.{leaf}:{class_name}' or the name {leaf!r}"
            ) from None
        raise
    class_name = import_path.rpartition(":")[2]
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise EnvironmentLoadError(
            f"environment {import_path!r}: {class_name} is not an Environment subclass; "
            "subclass environments.base.Environment"
        )
    if getattr(cls, "__abstractmethods__", None):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise EnvironmentLoadError(f"environment {import_path!r}: {class_name} does not implement {missing}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str):
        raise EnvironmentLoadError(
            f'environment {import_path!r}: {class_name}.name is not set; give the class a name, e.g. name = "my_env"'
        )
    try:
        check_env_name(name)
    except ValueError as error:
        raise EnvironmentLoadError(f"environment {import_path!r}: {class_name}.name: {error}") from error
    return cls


def load_config(cls: type[Environment], config: dict[str, Any] | EnvironmentConfig | None) -> EnvironmentConfig:
    """The environment's config validated now, with every bad field named."""
    if isinstance(config, cls.config_class):
        return config
    try:
        return cls.config_class.model_validate(dict(config or {}))
    except ValidationError as error:
        for problem in error.errors():  # a remote environment's service already named the field
            if isinstance(problem.get("ctx", {}).get("error"), EnvironmentLoadError):
                raise problem["ctx"]["error"] from None
        fields = ", ".join(cls.config_class.model_fields)
        raise EnvironmentLoadError(
            f"environment {cls.name} config: {describe_validation_error(error)} "
            f"(fields of {cls.config_class.__name__}: {fields})"
        ) from None
    except Exception as error:  # a check that makes the environment (a TextArena game) may download data
        if (message := fetch_failed(f"environment {cls.name} config", error)) is not None:
            raise EnvironmentLoadError(message) from error
        raise


def environment_items(
    name_or_path: str, config: dict[str, Any], tokenizer: str, count: int
) -> tuple[Environment, list[Item]]:
    """The environment `name_or_path` built offline (no policy client), set up, and its first `count`
    items in get_item's order: the prompts a run of it starts with, for what samples them elsewhere
    (TRL in the peer bench, a vLLM server alone in the scale bench)."""
    env = load_environment_class(name_or_path)(config, client=None, tokenizer=tokenizer)

    async def draw() -> list[Item]:
        await env.setup()
        return [await env.get_item() for _ in range(count)]

    return env, asyncio.run(draw())
