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
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from importlib.metadata import distributions
from pathlib import Path

READY = ".clotho-layer.json"  # written last: a layer without it was cut short and is built again
# What a project folder holds that is not its source: builds, caches, its own venv.
NOT_SOURCE = ("build", "*.egg-info", "__pycache__", ".venv", ".git")


class LayerError(RuntimeError):
    """The layer could not be built; the message has pip's last lines and the fix."""


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "clotho" / "env-venvs"


def pip_arguments(packages: list[str], requirement_files: list[str]) -> list[str]:
    """pip install's arguments: a requirements file as `-r FILE`, a project directory (a pyproject
    or setup.py) as itself, a package spec as given. A path that does not exist is an error here."""
    arguments = list(packages)
    for given in requirement_files:
        path = Path(given).expanduser().resolve()
        if path.is_dir():
            if not any((path / name).exists() for name in ("pyproject.toml", "setup.py")):
                raise LayerError(f"--requirements {given}: a directory without pyproject.toml or setup.py; give its requirements file")
            arguments.append(str(path))
        elif path.is_file():
            arguments += ["-r", str(path)]
        else:
            raise LayerError(f"--requirements {given}: no such file or directory")
    return arguments


def layer_key(arguments: list[str]) -> str:
    """A hash of the base environment (interpreter, installed distributions) and of what the layer
    adds (files and project directories by content)."""
    base = sorted(f"{d.metadata['Name']}=={d.version}" for d in distributions() if d.metadata["Name"])
    contents = []
    for argument in arguments:
        path = Path(argument)
        if path.is_file():
            contents.append(hashlib.sha256(path.read_bytes()).hexdigest())
        elif path.is_dir():  # installed as a copy: any change to its source is a new layer
            for file in source_files(path):
                contents.append(f"{file.relative_to(path)}:{hashlib.sha256(file.read_bytes()).hexdigest()}")
    blob = json.dumps({"prefix": sys.prefix, "python": sys.version, "base": base, "add": arguments, "contents": contents})
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def source_files(project: Path) -> list[Path]:
    """The project folder's files, NOT_SOURCE left out, in a fixed order."""
    files = []
    for directory, subdirectories, names in os.walk(project):
        subdirectories[:] = sorted(d for d in subdirectories if not any(fnmatch.fnmatch(d, p) for p in NOT_SOURCE))
        files += [Path(directory) / name for name in sorted(names) if not any(fnmatch.fnmatch(name, p) for p in NOT_SOURCE)]
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
    layer = (root or cache_root()) / layer_key(arguments)
    python = layer / "bin" / "python"
    if (layer / READY).exists() and python.exists():
        echo(f"the environment's own dependencies: {layer} (built before)")
        return python
    shutil.rmtree(layer, ignore_errors=True)  # a layer cut short
    layer.parent.mkdir(parents=True, exist_ok=True)
    echo(f"the environment's own dependencies: building {layer} over {sys.prefix} ({' '.join(arguments)})")
    subprocess.run([sys.executable, "-m", "venv", str(layer)], check=True)
    site_packages = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        check=True, capture_output=True, text=True).stdout.strip())  # fmt: skip
    base = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    # An executable .pth line: addsitedir also runs the base's own .pth files (editable installs).
    lines = [f"import site; site.addsitedir({path!r})" for path in sorted(base)]
    (site_packages / "_clotho_base.pth").write_text("\n".join(lines) + "\n")
    install = subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "--progress-bar", "off",
                              *built_elsewhere(arguments, layer / "src")], capture_output=True, text=True)  # fmt: skip
    if install.returncode != 0:
        tail = "\n".join((install.stdout + install.stderr).strip().splitlines()[-15:])
        raise LayerError(f"pip install {' '.join(arguments)} failed in {layer}:\n{tail}\nFix the requirement (a name, a version pin that exists) and run again")
    (layer / READY).write_text(json.dumps({"base": sys.prefix, "installed": arguments}))
    return python
