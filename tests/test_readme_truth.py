"""What the README and the docs tell a user to type exists: every `clotho` command and flag in a
code block, every `make` target, every file of the repository named, every `module:Class` of this
repository; and what the README says of the contracts (the schema version, the fields) is the code's."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import typer.main

from clotho.cli import app
from core.scored_group import SCHEMA_VERSION, ScoredGroup, ScoredSequence

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_BLOCK = re.compile(r"^```(?:bash|sh|shell|console)\n(.*?)^```", re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"`((?:clotho|make) [^`]+)`")
TOP_DIRS = "bench|clotho|cluster|core|docs|environments|flows|inference|requirements|runs|soak|storage|tests|trainer"
REPO_FILE = re.compile(rf"^(?:{TOP_DIRS})/[\w./-]*\w$")
MODULE_CLASS = re.compile(rf"^((?:{TOP_DIRS})(?:\.\w+)+):(\w+)$")
SEPARATORS = {"&&", "||", "|", ";", "&"}


def shell_lines(text: str) -> list[str]:
    """The command lines of a page's shell blocks (continuations joined) and its inline `clotho ...`
    and `make ...` spans."""
    lines = []
    for block in SHELL_BLOCK.findall(text):
        lines += [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    return lines + INLINE.findall(text)


def commands(line: str) -> list[list[str]]:
    """A line's commands as words: comments dropped, optional brackets taken off, split at && | ; &,
    variable assignments and sudo before the command left out."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote: prose, not a command
        return []
    words = [word.strip("[]") for word in words]
    found, current = [], []
    for word in [*words, ";"]:
        if word in SEPARATORS:
            while current and (re.match(r"^[A-Z_][A-Z0-9_]*=", current[0]) or current[0] in ("sudo", "export")):
                current.pop(0)
            if current:
                found.append(current)
            current = []
        elif word:
            current.append(word)
    return found


def click_problems(words: list[str]) -> list[str]:
    """A `clotho` command's subcommands and options that the command line does not have."""
    command = typer.main.get_command(app)  # typer's own click: groups are known by their commands
    path = ["clotho"]
    rest = words[1:]
    while hasattr(command, "commands") and rest and not rest[0].startswith("-"):
        if "|" in rest[0]:  # `clotho shards ls|show|verify`: each one of them
            absent = [name for name in rest[0].split("|") if name not in command.commands]
            return [f"`{' '.join(path)} {name}`: no such command" for name in absent]
        if rest[0] not in command.commands:
            return [f"`{' '.join(path)} {rest[0]}`: no such command (it has {', '.join(sorted(command.commands))})"]
        command = command.commands[rest[0]]  # type: ignore[attr-defined]
        path.append(rest.pop(0))
    options = {"--help"} | {
        name for param in command.params for name in [*param.opts, *getattr(param, "secondary_opts", [])]
    }
    return [
        f"`{' '.join(path)}` has no option {word.split('=')[0]}"
        for word in rest
        if word.startswith("-") and word != "-" and word.split("=")[0] not in options
    ]


def make_targets() -> list[re.Pattern]:
    """The Makefile's targets, a pattern rule's % standing for any name."""
    names = re.findall(r"^([\w.%/-]+):", (REPO / "Makefile").read_text(), re.MULTILINE)
    return [re.compile(re.escape(name).replace("%", r"[\w-]+") + "$") for name in names]


def word_problems(word: str) -> list[str]:
    """A file of this repository or a `module:Class` of it that is not there."""
    problems = []
    for part in {word, *word.split("=")[1:]}:
        part = part.removeprefix("./")
        if REPO_FILE.match(part) and not (REPO / part).exists():
            problems.append(f"{part}: no such file in the repository")
        if match := MODULE_CLASS.match(part):
            module = REPO / (match[1].replace(".", "/") + ".py")
            if not module.exists():
                problems.append(f"{part}: no module {module.relative_to(REPO)}")
            elif not re.search(rf"^class {match[2]}\b", module.read_text(), re.MULTILINE):
                problems.append(f"{part}: {module.relative_to(REPO)} has no class {match[2]}")
    return problems


def command_problems(words: list[str], targets: list[re.Pattern]) -> list[str]:
    """What one command names that is not there: a clotho command or option, a make target, a file."""
    program = Path(words[0]).name
    problems = click_problems(words) if program == "clotho" else []
    if program == "make":
        problems += [
            f"make {t}: no such target"
            for t in words[1:]
            if "=" not in t and not any(target.match(t) for target in targets)
        ]
    for flag, module in zip(words, words[1:]):  # python -m bench.report: a module of this repository
        path = REPO / module.replace(".", "/")
        if flag == "-m" and re.match(rf"^(?:{TOP_DIRS})\.", module):
            if not (path.with_suffix(".py").exists() or (path / "__init__.py").exists()):
                problems.append(f"-m {module}: no such module in the repository")
    return problems + [problem for word in words for problem in word_problems(word)]


def page_problems(page: Path) -> list[str]:
    targets = make_targets()
    return [
        f"{page.relative_to(REPO)}: {problem}"
        for line in shell_lines(page.read_text())
        for words in commands(line)
        for problem in command_problems(words, targets)
    ]


def test_every_command_flag_target_and_file_a_page_names_exists():
    problems = [problem for page in PAGES for problem in page_problems(page)]
    assert not problems, "\n".join(problems)


def test_the_checker_finds_what_is_not_there(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\n"
        "clotho run runs/nowhere.yaml --sett max_lag=1\n"
        "clotho envs list\n"
        "make demoo && clotho env check word_echo --server URL\n"
        ".venv-env-x/bin/clotho env serve environments.bundled.arithmetic:Arithmetik\n"
        "```\n"
        "```bash\npython -m bench.bench_nothing --rounds 1\n```\n"
        "Or `clotho rollout --groupz 4`, and `make test`.\n"
    )
    lines = shell_lines(page.read_text())
    problems = [p for line in lines for words in commands(line) for p in command_problems(words, make_targets())]
    assert problems == [
        "`clotho run` has no option --sett",
        "runs/nowhere.yaml: no such file in the repository",
        "`clotho envs`: no such command (it has demo, env, evaluate, model, reprocess, rollout, run, serve, "
        "shards, train, watch)",
        "make demoo: no such target",
        "environments.bundled.arithmetic:Arithmetik: environments/bundled/arithmetic.py has no class Arithmetik",
        "-m bench.bench_nothing: no such module in the repository",
        "`clotho rollout` has no option --groupz",
    ]


def test_the_readme_states_the_schema_version_and_every_field_of_the_contract():
    readme = (REPO / "README.md").read_text()
    stated = re.findall(r"schema version (\d+)", readme)
    assert stated and {int(v) for v in stated} == {SCHEMA_VERSION}, (stated, SCHEMA_VERSION)
    contract = readme[readme.index("**ScoredGroup**") : readme.index("**Shard schema")]
    missing = [
        name
        for name in [*ScoredSequence.model_fields, *ScoredGroup.model_fields]
        if name != "sequences" and f"`{name}`" not in contract
    ]
    assert not missing, f"README's ScoredGroup contract does not name {missing}"
