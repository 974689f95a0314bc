"""An environment's own dependencies: a Python environment layered on the one `clotho env serve`
runs in (an adapter's, .venv-env-atropos say, or clotho's own), with what the environment needs on
top (`--with gymnasium`, `--requirements requirements.txt`, or the environment's project directory
with its pyproject), built once and reused while neither side changes.

The layer is a venv whose site-packages first holds what was installed for the environment, then,
through a .pth file, everything of the base environment (clotho and the adapter's framework at
their locked versions, editable installs included). pip installs only what the base does not
already satisfy, so a layer costs seconds and megabytes, not a copy of the framework. Layers live
under $XDG_CACHE_HOME/clotho/env-venvs/ (~/.cache by default), named by a hash of the base
(its interpreter and every installed distribution's version) and of the requirements (files by
content): change either and a new layer is built, the old one is left for `rm -rf`.

An environment whose project asks for a Python this environment is not (`requires-python =
">=3.12"` over a 3.11 adapter venv, as OpenEnv's grid_world_env) cannot share its site-packages
(compiled extensions are built for one Python): its layer is a whole venv on an interpreter that
fits (the lowest found on PATH or among pyenv's versions), holding every distribution of this
environment at the version installed here (editable installs as editable), then the environment's
own requirements. Minutes the first time instead of seconds, reused after.
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from importlib.metadata import distributions
from pathlib import Path

from core.cache import cache_dir

READY = ".clotho-layer.json"  # written last: a layer without it was cut short and is built again
# What a project folder holds that is not its source: builds, caches, its own venv.
NOT_SOURCE = ("build", "*.egg-info", "__pycache__", ".venv", ".git")


class LayerError(RuntimeError):
    """The layer could not be built; the message has pip's last lines and the fix."""


def cache_root() -> Path:
    return cache_dir("env-venvs")


def pip_arguments(packages: list[str], requirement_files: list[str]) -> list[str]:
    """pip install's arguments: a requirements file as `-r FILE`, a project directory (a pyproject
    or setup.py) as itself, a package spec as given. A path that does not exist is an error here."""
    arguments = list(packages)
    for given in requirement_files:
        path = Path(given).expanduser().resolve()
        if path.is_dir():
            if not any((path / name).exists() for name in ("pyproject.toml", "setup.py")):
                raise LayerError(
                    f"--requirements {given}: a directory without pyproject.toml or setup.py; give its requirements file"
                )
            arguments.append(str(path))
        elif path.is_file():
            arguments += ["-r", str(path)]
        else:
            raise LayerError(f"--requirements {given}: no such file or directory")
    return arguments


def required_python(arguments: list[str]) -> list[tuple[str, str]]:
    """(specifier, where) for each project directory among the arguments whose pyproject says which
    Python it needs (`project.requires-python`)."""
    required = []
    for argument in arguments:
        pyproject = Path(argument) / "pyproject.toml"
        if pyproject.is_file():
            try:
                spec = tomllib.loads(pyproject.read_text()).get("project", {}).get("requires-python")
            except tomllib.TOMLDecodeError as error:
                raise LayerError(f"{pyproject}: not valid TOML ({error})") from error
            if spec:
                required.append((spec, str(pyproject)))
    return required


def fits(version: str, required: list[tuple[str, str]]) -> bool:
    from packaging.specifiers import SpecifierSet

    return all(SpecifierSet(spec).contains(version, prereleases=True) for spec, _ in required)


def candidate_pythons() -> list[str]:
    """Interpreters on this machine: python3.N on PATH, then pyenv's installed versions."""
    found = []
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        found += sorted(glob.glob(os.path.join(directory, "python3.[0-9]*")))
    pyenv = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    found += sorted(glob.glob(os.path.join(pyenv, "versions", "*", "bin", "python3")))
    return [path for path in found if re.fullmatch(r"python3(\.\d+)?", Path(path).name)]


def python_version(executable: str) -> str | None:
    """Its version ("3.12.1"), or None when it does not run (a pyenv shim of a version not selected)."""
    try:
        done = subprocess.run(
            [executable, "-c", "import sys; print('%d.%d.%d' % sys.version_info[:3])"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def find_python(required: list[tuple[str, str]]) -> tuple[str, str]:
    """(executable, version) of the lowest Python here that every requirement admits: the closest
    to this environment's, where its pinned packages most likely have wheels. Candidates are tried
    lowest first, by the version their path names, and only those it may fit are run."""

    def named(path: str) -> tuple[int, ...]:
        match = re.search(r"(\d+(?:\.\d+)+)", path.replace("python3.", "python-3."))
        return tuple(int(part) for part in match.group(1).split(".")) if match else (99,)

    for executable in sorted(candidate_pythons(), key=named):
        claimed = ".".join(map(str, named(executable)))
        if named(executable) != (99,) and not any(fits(f"{claimed}{patch}", required) for patch in ("", ".0", ".99")):
            continue
        version = python_version(executable)
        if version and fits(version, required):
            return executable, version
    asks = "; ".join(f"{where} asks for Python {spec}" for spec, where in required)
    raise LayerError(
        f"{asks}, this environment is Python {platform_version()} and no Python that fits was found on PATH or "
        "among pyenv's versions: install one (pyenv install 3.12, or your system's python3.12 package) and run again"
    )


def platform_version() -> str:
    return ".".join(map(str, sys.version_info[:3]))


def installed() -> list:
    """This environment's distributions: those in its site-packages, not whatever the working
    directory holds (a checkout's *.egg-info on sys.path would change the layer's key)."""
    return list(distributions(path=sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})))


def base_pins() -> list[str]:
    """pip install arguments for every distribution of this environment as installed here: NAME==VERSION,
    or `-e DIR` / DIR for one installed from a local directory (clotho itself, editable)."""
    pins = []
    for dist in sorted(installed(), key=lambda d: (d.metadata["Name"] or "").lower()):
        name = dist.metadata["Name"]
        if not name or name.lower() == "pip":
            continue
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
        url = direct.get("url", "")
        if url.startswith("file://") and "dir_info" in direct:
            path = url.removeprefix("file://")
            pins += ["-e", path] if direct["dir_info"].get("editable") else [path]
        else:
            pins.append(f"{name}=={dist.version}")
    return pins


def layer_key(arguments: list[str], python: str | None = None) -> str:
    """A hash of the base environment (interpreter, installed distributions) and of what the layer
    adds (files and project directories by content), and of the interpreter of a whole venv."""
    base = sorted(f"{d.metadata['Name']}=={d.version}" for d in installed() if d.metadata["Name"])
    contents = []
    for argument in arguments:
        path = Path(argument)
        if path.is_file():
            contents.append(hashlib.sha256(path.read_bytes()).hexdigest())
        elif path.is_dir():  # installed as a copy: any change to its source is a new layer
            for file in source_files(path):
                contents.append(f"{file.relative_to(path)}:{hashlib.sha256(file.read_bytes()).hexdigest()}")
    blob = {"prefix": sys.prefix, "python": sys.version, "base": base, "add": arguments, "contents": contents}
    if python:
        blob["whole venv on"] = python
    blob = json.dumps(blob)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def source_files(project: Path) -> list[Path]:
    """The project folder's files, NOT_SOURCE left out, in a fixed order."""
    files = []
    for directory, subdirectories, names in os.walk(project):
        subdirectories[:] = sorted(d for d in subdirectories if not any(fnmatch.fnmatch(d, p) for p in NOT_SOURCE))
        files += [
            Path(directory) / name for name in sorted(names) if not any(fnmatch.fnmatch(name, p) for p in NOT_SOURCE)
        ]
    return files


def built_elsewhere(arguments: list[str], where: Path) -> list[str]:
    """The arguments with each project directory copied under `where` first: pip builds a project
    in its own tree (build/, *.egg-info), and the environment's source stays as it was."""
    copied = []
    for argument in arguments:
        path = Path(argument)
        if path.is_dir():
            target = where / f"{len(copied)}-{path.name}"
            shutil.copytree(path, target, ignore=shutil.ignore_patterns(*NOT_SOURCE))
            argument = str(target)
        copied.append(argument)
    return copied


def environment_layer(arguments: list[str], root: Path | None = None, echo=print) -> Path:
    """The python of the layer holding `arguments` (pip install's) over this environment: reused
    when built before, else built now. LayerError when pip fails."""
    required = required_python(arguments)
    interpreter, version = (None, None) if fits(platform_version(), required) else find_python(required)
    layer = (root or cache_root()) / layer_key(arguments, interpreter)
    python = layer / "bin" / "python"
    if (layer / READY).exists() and python.exists():
        echo(f"the environment's own dependencies: {layer} (built before)")
        return python
    shutil.rmtree(layer, ignore_errors=True)  # a layer cut short
    layer.parent.mkdir(parents=True, exist_ok=True)
    if interpreter is None:
        echo(f"the environment's own dependencies: building {layer} over {sys.prefix} ({' '.join(arguments)})")
        subprocess.run([sys.executable, "-m", "venv", str(layer)], check=True)
        site_packages = Path(
            subprocess.run(
                [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.strip()
        )
        base = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
        # An executable .pth line: addsitedir also runs the base's own .pth files (editable installs).
        lines = [f"import site; site.addsitedir({path!r})" for path in sorted(base)]
        (site_packages / "_clotho_base.pth").write_text("\n".join(lines) + "\n")
    else:
        asks = ", ".join(f"{spec} ({Path(where).parent.name})" for spec, where in required)
        echo(
            f"the environment asks for Python {asks} and this one is {platform_version()}: building a whole venv "
            f"{layer} on Python {version} ({interpreter}) with this environment's packages at their versions, "
            f"then {' '.join(arguments)} (minutes, once)"
        )
        subprocess.run([interpreter, "-m", "venv", str(layer)], check=True)
        _pip(python, ["--no-deps", *base_pins()], layer, f"this environment's packages on Python {version}")
    _pip(python, built_elsewhere(arguments, layer / "src"), layer, " ".join(arguments))
    (layer / READY).write_text(
        json.dumps({"base": sys.prefix, "installed": arguments, "python": interpreter or sys.executable})
    )
    return python


def _pip(python: Path, arguments: list[str], layer: Path, what: str) -> None:
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off", *arguments],
        capture_output=True,
        text=True,
    )
    if install.returncode != 0:
        tail = "\n".join((install.stdout + install.stderr).strip().splitlines()[-15:])
        raise LayerError(
            f"pip install {what} failed in {layer}:\n{tail}\nFix the requirement (a name, a version pin that exists) and run again"
        )
