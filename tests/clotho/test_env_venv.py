"""An environment's own dependencies (clotho/env_venv.py): a layer over the running environment
with what it adds, built once and reused, the base's packages (clotho itself, editable) behind it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from clotho.env_venv import (
    LayerError,
    base_pins,
    environment_layer,
    find_python,
    fits,
    layer_key,
    pip_arguments,
    python_version,
    required_python,
)


def project(root: Path, version: str, requires_python: str | None = None) -> Path:
    """A one-module project of its own, as an environment's package would be."""
    root.mkdir(parents=True, exist_ok=True)
    asks = f'requires-python = "{requires_python}"\n' if requires_python else ""
    (root / "pyproject.toml").write_text(
        f'[project]\nname = "clotho-layer-probe"\nversion = "{version}"\n{asks}[build-system]\nrequires = ["setuptools"]\n'
        'build-backend = "setuptools.build_meta"\n[tool.setuptools]\npy-modules = ["layer_probe"]\n'
    )
    (root / "layer_probe.py").write_text(f"VERSION = {version!r}\n")
    return root


@pytest.mark.slow
def test_a_layer_adds_what_the_environment_needs_over_the_base_and_is_built_once(tmp_path) -> None:
    source = project(tmp_path / "probe", "1.0")
    said: list[str] = []
    python = environment_layer(pip_arguments([], [str(source)]), root=tmp_path / "layers", echo=said.append)
    probe = "import layer_probe, pydantic, clotho.env_venv; print(layer_probe.VERSION, pydantic.__file__)"
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "1.0" and str(tmp_path) not in out[1]  # its own package; the base's pydantic, not a copy
    assert environment_layer(pip_arguments([], [str(source)]), root=tmp_path / "layers", echo=said.append) == python
    assert said[-1].endswith("(built before)")
    project(source, "2.0")  # the environment changed: a new layer
    assert environment_layer(pip_arguments([], [str(source)]), root=tmp_path / "layers", echo=said.append) != python


def test_a_project_s_source_decides_its_layer_not_its_builds(tmp_path) -> None:
    """A project folder is installed as a copy: a change to any of its source files is a new
    layer, while what a build leaves in it (build/, *.egg-info, __pycache__) is not."""
    source = project(tmp_path / "probe", "1.0")
    key = layer_key(pip_arguments([], [str(source)]))
    (source / "build" / "lib").mkdir(parents=True)
    (source / "build" / "lib" / "layer_probe.py").write_text("stale\n")
    assert layer_key(pip_arguments([], [str(source)])) == key
    (source / "layer_probe.py").write_text("VERSION = '1.0'  # edited\n")
    assert layer_key(pip_arguments([], [str(source)])) != key


def test_requirements_that_cannot_be_met_say_so(tmp_path) -> None:
    with pytest.raises(LayerError, match="--requirements nowhere.txt: no such file"):
        pip_arguments([], ["nowhere.txt"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(LayerError, match="without pyproject.toml or setup.py"):
        pip_arguments([], [str(tmp_path / "empty")])
    (tmp_path / "reqs.txt").write_text("gymnasium\n")
    assert pip_arguments(["numpy<3"], [str(tmp_path / "reqs.txt")]) == ["numpy<3", "-r", str(tmp_path / "reqs.txt")]


@pytest.mark.slow
def test_a_failed_install_names_pip_s_reason_and_leaves_no_layer_to_reuse(tmp_path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "setup.py").write_text("raise SystemExit('this project does not build')\n")
    with pytest.raises(LayerError, match="(?s)failed in .*this project does not build.*Fix the requirement"):
        environment_layer(pip_arguments([], [str(broken)]), root=tmp_path / "layers", echo=lambda _: None)
    assert not list((tmp_path / "layers").glob("*/.clotho-layer.json"))


def test_a_project_that_asks_for_another_python_gets_one_that_fits_or_says_how_to(tmp_path) -> None:
    """OpenEnv's grid_world_env asks for Python >= 3.12 over 3.11 adapter venvs: its layer is a whole
    venv on the lowest interpreter here that fits, with the base's packages at their versions."""
    here = ".".join(map(str, sys.version_info[:3]))
    plain = project(tmp_path / "plain", "1.0", requires_python=f">={sys.version_info[0]}.{sys.version_info[1]}")
    assert fits(here, required_python(pip_arguments([], [str(plain)])))
    later = required_python(pip_arguments([], [str(project(tmp_path / "later", "1.0", requires_python=">=3.99"))]))
    assert later == [(">=3.99", str(tmp_path / "later" / "pyproject.toml"))] and not fits(here, later)
    with pytest.raises(
        LayerError, match=r"(?s)later/pyproject.toml asks for Python >=3.99.*no Python that fits.*pyenv install"
    ):
        find_python(later)
    executable, version = find_python([(f">={here}", "x")])  # this one, or another at least as new
    assert python_version(executable) == version and fits(version, [(f">={here}", "x")])
    pins = base_pins()
    assert "-e" in pins and str(Path(__file__).resolve().parents[2]) in pins  # clotho itself, editable
    assert any(pin.lower().startswith("pydantic==") for pin in pins) and not any(
        pin.startswith("pip==") for pin in pins
    )
    assert layer_key(pip_arguments([], [str(plain)])) != layer_key(pip_arguments([], [str(plain)]), executable)


def test_a_layer_s_key_does_not_depend_on_the_working_directory(tmp_path) -> None:
    """From a checkout, its clotho.egg-info is on sys.path as well as the installed clotho: the key
    (and the pins of a whole venv) come from site-packages only, so `clotho env serve` and a
    script run elsewhere find the same layer."""
    source = project(tmp_path / "probe", "1.0")
    code = (
        "from clotho.env_venv import layer_key, pip_arguments, base_pins; "
        f"print(layer_key(pip_arguments([], [{str(source)!r}])), len(base_pins()))"
    )
    here, elsewhere = (
        subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=True).stdout
        for cwd in (Path(__file__).resolve().parents[2], tmp_path)
    )
    assert here == elsewhere
