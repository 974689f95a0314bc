"""Publishing a step: Hugging Face weights for inference, read by vLLM and transformers.

The published checkpoint `{root}/{run}/checkpoints/step-{N:08d}/` (storage.checkpoints) holds HF
safetensors in the servers' dtype, config, generation config, tokenizer and the parity reference;
every `full_every`-th publish in full, the ones between as deltas on the one before
(DeltaPublisher). A trainer resumed from an older state (trainer.resume_state) trains the steps
since again and finds their checkpoints already published (replay_difference checks it got the
same weights), or deleted by retention (then they are not published again: LATEST never goes back).
"""

from __future__ import annotations

import functools
import logging
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from inference.parity import PARITY_REFERENCE, model_logprobs, parse_parity_reference, write_parity_reference
from inference.parity_guard import worst_difference
from storage import weight_delta
from storage.checkpoints import (
    CheckpointError,
    checkpoint_url,
    latest_checkpoint,
    publish_checkpoint,
    read_checkpoint,
)
from storage.filesystem import resolve, retrying
from storage.layout import join
from storage.weight_delta import DELTA_FILE, WEIGHTS_FILE

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)
Tied = TypeVar("Tied")

# A step trained again from the same groups and state gives the same weights on CPU; GPUs' kernels
# may differ in the last bits, which a few steps compound.
REPLAY_TOLERANCE = 1e-4


def hf_state_dict(engine, zero_stage: int) -> dict[str, torch.Tensor] | None:
    """The full model state dict on rank 0 (None elsewhere). Collective under ZeRO-3: every rank
    must call it, since the parameters are sharded and have to be gathered."""
    if zero_stage == 3:
        return engine._zero3_consolidated_16bit_state_dict()
    if torch.distributed.get_rank() != 0:
        return None
    return {name: tensor.detach().cpu() for name, tensor in engine.module.state_dict().items()}


@functools.lru_cache(maxsize=4)
def base_tokenizer(name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


@functools.lru_cache(maxsize=4)
def parity_sequences(tokenizer_source: str) -> list[list[int]]:
    """The parity guard's prompts as token ids of the base model's tokenizer."""
    from inference.parity_guard import default_prompt_ids

    return default_prompt_ids(base_tokenizer(tokenizer_source))


class Cast:
    """A tensor's bytes in `dtype`, cast a slice at a time as they are read (weight_delta.Chunked):
    nothing holds the whole tensor cast."""

    def __init__(self, tensor: torch.Tensor, dtype: torch.dtype):
        self.flat, self.dtype, self.shape = tensor.detach().reshape(-1), dtype, tuple(tensor.shape)
        self.item_size = torch.empty((), dtype=dtype).element_size()
        self.nbytes = self.flat.numel() * self.item_size

    def __call__(self, part: slice) -> np.ndarray:
        chunk = self.flat[part.start // self.item_size : part.stop // self.item_size]
        return chunk.to(self.dtype).contiguous().view(torch.uint8).numpy()

    def entry(self) -> tuple[str, tuple[int, ...], Cast]:
        """As weight_delta's functions take a tensor: (safetensors dtype, shape, bytes)."""
        return SAFETENSORS_DTYPES[self.dtype], self.shape, self


def published_tensors(
    module: PreTrainedModel, state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None
) -> dict[str, Cast]:
    """The tensors a checkpoint of `state_dict` holds, in `dtype` (None: as they are), cast when
    read; a tensor the state dict names twice (a tied head) is one Cast named twice.

    With tied embeddings they include `lm_head.weight`, the tensor of `model.embed_tokens.weight`:
    transformers ties it again on load (and save_pretrained would leave it out), but vLLM's in-place
    reload only copies the tensors it is given, so without it the served head would keep the old
    weights."""
    cast: dict[int, Cast] = {}  # by the source's data pointer
    tensors = {}
    for name, tensor in state_dict.items():
        if tensor.data_ptr() not in cast:
            cast[tensor.data_ptr()] = Cast(tensor, dtype or tensor.dtype)
        tensors[name] = cast[tensor.data_ptr()]
    return with_tied_head(module, tensors)


def with_tied_head(module: PreTrainedModel, tensors: dict[str, Tied]) -> dict[str, Tied]:
    """`tensors` with `lm_head.weight` the embedding's entry where the model ties them."""
    if module.config.tie_word_embeddings:
        embedding = "model.embed_tokens.weight"
        if embedding not in tensors:
            raise ValueError(
                f"the state dict has no {embedding}; published_tensors knows the Qwen2/Llama naming of tied "
                "embeddings only, extend it for this architecture"
            )
        tensors["lm_head.weight"] = tensors[embedding]
    return tensors


def save_hf_checkpoint(
    module: PreTrainedModel,
    tensors: dict[str, Cast] | None,
    tokenizer_source: str,
    out: Path,
    dtype: torch.dtype | None = None,
) -> None:
    """Write `module`'s config (naming `dtype`, when given) and generation config, `tensors`
    (published_tensors) as one safetensors file, and the tokenizer of `tokenizer_source` (the base
    model) to `out`: a directory vLLM and transformers load. `tensors` None writes everything but
    the weights (a delta step's)."""
    import copy

    config = copy.deepcopy(module.config)
    if dtype is not None:
        config.dtype = dtype
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    if getattr(module, "generation_config", None) is not None:
        module.generation_config.save_pretrained(out)
    if tensors is not None:
        entries = {name: cast.entry() for name, cast in tensors.items()}
        weight_delta.write_safetensors(entries, out / WEIGHTS_FILE, metadata={"format": "pt"})
    base_tokenizer(tokenizer_source).save_pretrained(out)


@dataclass
class DeltaPublisher:
    """What the next publish's delta is taken against: a copy of the previous publish's tensors (on
    rank 0, in the published dtype) and the chain it was built from. A full checkpoint every
    `full_every` publishes, the ones between as deltas (storage.weight_delta); a delta that would not
    save half the bytes of a full checkpoint (weights that all move, in fp32) is published full
    instead.

    The copy is a file in `directory` (a local disk; None: the system's temporary directory),
    unlinked, read and written a chunk at a time: a publish casts the weights into it as the delta
    XORs them (weight_delta.encode's in_place). So the trainer's own memory holds no second copy of
    the weights (0.99 GB at the 0.5B shape in bf16: its peak over weights, gradients and optimizer
    state went from +23% to +36% with it), and the page cache holding it is the kernel's to write out
    and drop."""

    full_every: int
    directory: Path | None = None
    step: int | None = None  # the publish the file holds; None: none (the next publish is full)
    chain: list[int] = field(default_factory=list)  # of the previous publish
    skip: int = 0  # publishes left that go full without trying a delta, after one that was too big
    kept: dict[str, weight_delta.Region] = field(default_factory=dict, repr=False)
    layout: dict[str, tuple] = field(default_factory=dict, repr=False)  # name -> (dtype, shape) in the file
    file: IO[bytes] | None = field(default=None, repr=False)

    def publishing(self, tensors: dict[str, Cast]) -> tuple[bytes, list[int]] | None:
        """The delta of `tensors` (published_tensors) with the chain it extends, None when a full
        checkpoint is due. Until `published`, nothing is taken as published: a publish that fails
        midway leaves the next one full."""
        base, self.step = self.step, None
        if self.full_every == 1:
            return None
        entries = {name: cast.entry() for name, cast in tensors.items()}
        if self.layout != {name: (dtype, shape) for name, (dtype, shape, _) in entries.items()}:
            self.keep(tensors)
            base = None
        due = base is not None and len(self.chain) + 1 < self.full_every
        if due and self.skip:
            self.skip -= 1
            due = False
        if not due or base is None:
            weight_delta.fill(entries, self.kept)
            return None
        delta = weight_delta.encode(entries, self.kept, base, in_place=True)
        aliases = weight_delta.same_memory(entries, self.kept)
        full = sum(region.nbytes for name, region in self.kept.items() if name not in aliases)
        if len(delta) > full / 2:
            self.skip = self.full_every - 1
            log.info(
                "publishing in full: a delta would be %.0f%% of the weights' bytes (the next %d publishes too)",
                100 * len(delta) / full,
                self.skip,
            )
            return None
        return delta, [*self.chain, base]

    def keep(self, tensors: dict[str, Cast]) -> None:
        """A new file laid out for `tensors`, one region per distinct tensor (a tied head shares
        the embedding's)."""
        self.file = tempfile.TemporaryFile(prefix="clotho-published-", dir=self.directory)
        regions: dict[int, weight_delta.Region] = {}  # by Cast
        offset = 0
        for cast in tensors.values():
            if id(cast) not in regions:
                regions[id(cast)] = weight_delta.Region(self.file.fileno(), offset, cast.nbytes)
                offset += cast.nbytes
        self.kept = {name: regions[id(cast)] for name, cast in tensors.items()}
        self.layout = {name: (SAFETENSORS_DTYPES[cast.dtype], cast.shape) for name, cast in tensors.items()}

    def published(self, step: int, chain: list[int]) -> None:
        """The tensors `publishing` was given are step `step`'s, built from `chain` (empty: in full)."""
        if self.full_every > 1:
            self.step, self.chain = step, chain

    def forget(self) -> None:
        """After a step it did not publish itself: the next publish is full."""
        self.step, self.chain = None, []


SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def raw_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's bytes as a uint8 array (no copy)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def publish_step(
    engine,
    *,
    zero_stage: int,
    base_model: str,
    storage: str,
    run: str,
    step: int,
    extra: dict[str, Any],
    storage_options: dict[str, Any] | None = None,
    staging_dir: Path | None = None,
    dtype: str | None = None,
    deltas: DeltaPublisher | None = None,
) -> str | None:
    """Publish the engine's weights as checkpoint step N (rank 0 writes; call on every rank), in
    `dtype` (None: the weights' own), as a delta on the previous publish where `deltas` says so.

    Returns the checkpoint URL on rank 0, None on other ranks. A step already published (STABLE)
    is left alone: it was written by an earlier run of the same steps that died before saving its
    resume state, and training is deterministic, so it holds these weights. The HF files are
    saved to a temporary directory under `staging_dir` (the system's temporary directory when
    None) and uploaded from there; a trainer killed meanwhile leaves it behind, so give a
    directory that the next start empties (`clear_staging`).
    """
    state_dict = hf_state_dict(engine, zero_stage)
    if state_dict is None:
        return None
    url = checkpoint_url(storage, run, step)
    torch_dtype = getattr(torch, dtype) if dtype else None
    try:
        read_checkpoint(url, storage_options=storage_options)
        already = True
    except CheckpointError:
        already = False
    newest = None if already else latest_checkpoint(storage, run, storage_options=storage_options)
    if newest is not None and newest.step > step:
        # Published by an earlier run of these steps and deleted by retention since: the servers are
        # past it, and publishing it again would take LATEST back. The next step publishes in full.
        if deltas is not None:
            deltas.forget()
        log.info("%s was published and retention deleted it: not published again (LATEST: %d)", url, newest.step)
        return url
    tensors = published_tensors(engine.module, state_dict, torch_dtype)
    if already:
        if deltas is not None:
            deltas.forget()
        difference = replay_difference(engine.module, url, zero_stage, storage_options, torch_dtype)
        if difference is None:
            log.warning("%s is already published (by a run that died before saving its state)", url)
        elif difference <= REPLAY_TOLERANCE:
            log.info(
                "%s is already published: the step trained again gives its stored logprobs (max difference %.2g)",
                url,
                difference,
            )
        else:
            log.warning(
                "%s is already published, from other weights: the step trained again differs from its stored "
                "logprobs by %.3g (its groups were read in another order than the first time); training goes "
                "on from the weights trained now",
                url,
                difference,
            )
        return url
    encoded = deltas.publishing(tensors) if deltas is not None else None
    with tempfile.TemporaryDirectory(prefix="clotho-checkpoint-", dir=staging_dir) as temporary:
        save_hf_checkpoint(engine.module, None if encoded else tensors, base_model, Path(temporary), torch_dtype)
        if encoded:
            (Path(temporary) / DELTA_FILE).write_bytes(encoded[0])
            extra = {**extra, "delta": {"chain": encoded[1]}}
        if zero_stage < 3 and all(p.dtype == torch.float32 for p in engine.module.parameters()):
            # The weights' own logprobs, which servers that load them must give (inference.parity):
            # one short forward here spares every reload a load and forward of the whole model.
            write_parity_reference(engine.module, parity_sequences(base_model), Path(temporary), torch_dtype)
        publish_checkpoint(temporary, storage, run, step, extra=extra, storage_options=storage_options)
    if deltas is not None:
        deltas.published(step, encoded[1] if encoded else [])
    return url


def replay_difference(
    module: PreTrainedModel,
    url: str,
    zero_stage: int,
    storage_options: dict[str, Any] | None,
    dtype: torch.dtype | None = None,
) -> float | None:
    """The largest |logprob difference| between `module` (computed as published in `dtype`) and the
    published checkpoint at `url` on the sequences its parity reference stores; None when it stores
    none or the module is sharded (ZeRO-3).
    A trainer resumed from an older state trains the steps since again: this says whether it got the
    same weights, for one forward of a few short sequences instead of reading the checkpoint back."""
    if zero_stage == 3:
        return None
    fs, path = resolve(url, storage_options)
    try:
        text = retrying(fs, join(path, PARITY_REFERENCE), fs.cat_file, join(path, PARITY_REFERENCE)).decode()
    except FileNotFoundError:
        return None
    sequences, stored = parse_parity_reference(text, f"{url}/{PARITY_REFERENCE}")
    return worst_difference(zip(model_logprobs(module, sequences, dtype), stored))


def clear_staging(staging_dir: Path) -> None:
    """Empty the run's staging directory at start: what is there is a checkpoint a killed trainer
    was publishing (a whole model's weights), which nothing will ever upload."""
    if staging_dir.exists():
        left = list(staging_dir.iterdir())
        if left:
            log.info("removing %d checkpoint(s) a previous trainer left staged in %s", len(left), staging_dir)
        shutil.rmtree(staging_dir, ignore_errors=True)
    staging_dir.mkdir(parents=True, exist_ok=True)
