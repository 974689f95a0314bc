"""Weights published as deltas: each tensor's bytes XOR the previous publish's, zstd-compressed, with a
checksum of the tensor it gives.

A step of a run trained at a small learning rate in bf16 changes a few percent of the weights' bytes
(the rest round to the value they had), so the XOR against the previous publish is mostly zeros and
compresses to a few percent of the full file. The trainer (trainer.publishing) writes a full
checkpoint every `full_every` publishes and deltas between them; a reader (storage.checkpoints.
fetch_checkpoint) rebuilds step N from the last full one and the deltas up to N, tensor by tensor,
and checks each rebuilt tensor against the checksum (XXH3-64) the trainer computed from its own bytes. A delta
applied to other bytes than it was made against (a torn copy, a wrong base) fails that check and
never reaches a server. The rebuilt file is byte for byte the full checkpoint the trainer would have
written: the base's safetensors header with every tensor's new bytes.

    delta file = [8 bytes: header length, little endian][header JSON][compressed blobs]
    header     = {"format", "base": step it XORs against, "chunk": bytes a chunk of a tensor holds,
                  "tensors": {name: {"dtype", "shape", "size", "start", "chunks": [[length, xxh3_64], ...]}
                              or {"dtype", "shape", "size", "same_as": name}}}

A tensor the trainer publishes under two names (a tied LM head: the embedding's tensor) is encoded
once; the other name says `same_as`, and a reader writes the same bytes there (at the 0.5B shape the
head is 272 MB of the 1,265).

A tensor's bytes are taken CHUNK at a time (the last chunk shorter): each chunk's XOR is compressed
on its own, its blobs follow one another from `start`, and each has the XXH3-64 of the chunk of the
tensor it must give. Both sides work a chunk at a time on a few threads, so every buffer they touch
is a chunk's, reused: neither holds or faults in a copy of a whole tensor (an embedding over a real
vocabulary is hundreds of MB; on a VM, memory touched for the first time costs seconds a GB).
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

WEIGHTS_FILE = "model.safetensors"
DELTA_FILE = "model.safetensors.delta"
FORMAT = "clotho-xor-zstd-4"
CHUNK = 4 * 2**20
LEVEL = 1  # zstd level: XORs of nearby weights are mostly zeros, which level 1 already packs tightly
WORKERS = min(4, os.cpu_count() or 1)


class DeltaError(ValueError):
    """A delta that cannot be applied: unreadable, against other tensors, or giving other bytes than
    the trainer's (checksum)."""


def _codec():
    import pyarrow  # zstd without another dependency: pyarrow ships it, and the storage layer has pyarrow

    return pyarrow.Codec("zstd", compression_level=LEVEL)


def _words(data: np.ndarray) -> np.ndarray:
    """uint8 bytes as 8-byte words where they divide evenly: the XOR runs 8x fewer operations."""
    return data.view(np.uint64) if data.size % 8 == 0 else data


def xor_into(target: np.ndarray, other: np.ndarray) -> None:
    np.bitwise_xor(_words(target), _words(other), out=_words(target))


def checksum(data: np.ndarray) -> int:
    """XXH3-64 of `data`: 0.08 s a GB here, against CRC-32's 0.48 s (zlib), which both a publish and
    a rebuild pay over the whole model."""
    import xxhash  # not in the policy server's environment, which imports this module for its header reader

    return xxhash.xxh3_64_intdigest(data.data)


class _Scratch(threading.local):
    """A chunk-sized buffer per thread, reused from chunk to chunk."""

    buffer = np.empty(0, dtype=np.uint8)

    def take(self, size: int) -> np.ndarray:
        if self.buffer.size < size:
            self.buffer = np.empty(size, dtype=np.uint8)
        return self.buffer[:size]


_scratch, _kept_chunk = _Scratch(), _Scratch()


def _each(function, items):
    """`function` over `items` on a few threads (zstd and numpy let go of the GIL), in order."""
    with ThreadPoolExecutor(WORKERS) as pool:
        return list(pool.map(function, items))


def chunk_slices(size: int) -> list[slice]:
    return [slice(start, min(start + CHUNK, size)) for start in range(0, size, CHUNK)] or [slice(0, 0)]


class Chunked(Protocol):
    """A tensor's `nbytes` bytes given a slice at a time (a cast done a chunk at a time)."""

    nbytes: int

    def __call__(self, part: slice) -> np.ndarray: ...


Bytes = np.ndarray | Chunked


@dataclass(frozen=True)
class Region:
    """Bytes offset:offset + nbytes of an open local file (descriptor `file`), read and written a
    chunk at a time: a copy of weights kept in the page cache, which the kernel may write out and
    drop, instead of in a process's own memory."""

    file: int
    offset: int
    nbytes: int

    def read(self, part: slice, into: np.ndarray) -> np.ndarray:
        if os.preadv(self.file, [into.data], self.offset + part.start) != into.size:
            raise DeltaError(f"the kept weights' file ends before byte {self.offset + part.stop}")
        return into

    def write(self, part: slice, data: np.ndarray) -> None:
        if os.pwrite(self.file, data.data, self.offset + part.start) != data.nbytes:
            raise OSError(f"a short write of the kept weights' file at byte {self.offset + part.start}")


Kept = np.ndarray | Region  # a tensor's bytes in memory, or in a file


def encode(
    tensors: Mapping[str, tuple[str, Sequence[int], Bytes]],
    previous: Mapping[str, Kept],
    base: int,
    in_place: bool = False,
) -> bytes:
    """The delta of `tensors` (name -> (dtype, shape, raw bytes as uint8, or a Chunked giving a
    slice of them)) against `previous` (name -> raw bytes of the publish `base`, in memory or a
    Region of a file): raises DeltaError unless both hold the same tensors of the same byte sizes (a
    full checkpoint is then due). `in_place` (`previous` all Regions): each chunk of `previous` is
    written over with the tensors' bytes once XORed, so a publisher keeps one copy of the weights,
    not two."""
    if in_place and not all(isinstance(kept, Region) for kept in previous.values()):
        raise TypeError("encode(in_place=True) writes the tensors' bytes into Regions of a file: give Regions")
    if tensors.keys() != previous.keys():
        raise DeltaError(f"tensors differ from step {base}'s: {sorted(tensors.keys() ^ previous.keys())[:5]}")
    for name, (_, _, data) in tensors.items():
        if data.nbytes != previous[name].nbytes:
            raise DeltaError(f"{name} has {data.nbytes} bytes, {previous[name].nbytes} at step {base}")
    aliases = same_memory(tensors, previous)
    pieces = [(name, part) for name in tensors if name not in aliases for part in chunk_slices(previous[name].nbytes)]

    def one(piece: tuple[str, slice]) -> tuple[bytes, int]:
        name, part = piece
        source, kept = tensors[name][2], previous[name]
        data = source[part] if isinstance(source, np.ndarray) else source(part)
        size = part.stop - part.start
        if data.nbytes != size:
            raise DeltaError(f"{name} gives {data.nbytes} bytes for {part.start}:{part.stop}, not {size}")
        before = kept.read(part, _kept_chunk.take(size)) if isinstance(kept, Region) else kept[part]
        difference = _scratch.take(size)
        np.bitwise_xor(_words(data), _words(before), out=_words(difference))
        if in_place and isinstance(kept, Region):  # every one is, when in_place (checked above)
            kept.write(part, data)
        return _codec().compress(difference, asbytes=True), checksum(data)

    blobs = iter(_each(one, pieces))
    header: dict[str, dict] = {}
    written, start = [], 0
    for name, (dtype, shape, _) in tensors.items():
        size = int(previous[name].nbytes)
        if name in aliases:
            header[name] = {"dtype": dtype, "shape": list(shape), "size": size, "same_as": aliases[name]}
            continue
        chunks = [next(blobs) for _ in chunk_slices(size)]
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "size": size,
            "start": start,
            "chunks": [[len(blob), xxh3] for blob, xxh3 in chunks],
        }
        start += sum(len(blob) for blob, _ in chunks)
        written += [blob for blob, _ in chunks]
    head = json.dumps(
        {"format": FORMAT, "base": base, "chunk": CHUNK, "tensors": header}, separators=(",", ":")
    ).encode()
    return b"".join([struct.pack("<Q", len(head)), head, *written])


def fill(tensors: Mapping[str, tuple[str, Sequence[int], Bytes]], kept: Mapping[str, Region]) -> None:
    """Write each tensor's bytes into its Region of `kept`, a chunk at a time (a tensor named twice,
    once)."""
    aliases = same_memory(tensors, kept)

    def one(piece: tuple[str, slice]) -> None:
        name, part = piece
        source = tensors[name][2]
        kept[name].write(part, source[part] if isinstance(source, np.ndarray) else source(part))

    _each(one, [(name, part) for name in tensors if name not in aliases for part in chunk_slices(kept[name].nbytes)])


def same_memory(
    tensors: Mapping[str, tuple[str, Sequence[int], Bytes]], previous: Mapping[str, Kept]
) -> dict[str, str]:
    """name -> the first name of `tensors` that is the very same tensor: its bytes the same memory
    (or the same Chunked), and so are the previous publish's (or the same Region)."""

    def place(data) -> object:
        if isinstance(data, np.ndarray):
            return data.__array_interface__["data"][0], int(data.nbytes)
        return data if isinstance(data, Region) else id(data)

    first: dict[tuple, str] = {}
    aliases = {}
    for name, (_, _, data) in tensors.items():
        key = (place(data), place(previous[name]))
        if key in first and previous[name].nbytes:
            aliases[name] = first[key]
        first.setdefault(key, name)
    return aliases


def read_delta(data: bytes, where: str) -> tuple[dict, memoryview]:
    """A delta's header and its blobs."""
    try:
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + size])
    except (struct.error, ValueError) as error:
        raise DeltaError(f"{where} is not a weight delta: {error}") from None
    if header.get("format") != FORMAT:
        raise DeltaError(f"{where} is in format {header.get('format')!r}, this reader knows {FORMAT!r}")
    return header, memoryview(data)[8 + size :]


def safetensors_header(path: Path, error: type[Exception] = DeltaError) -> tuple[bytes, dict]:
    """A safetensors file's header, raw (8-byte size included) and parsed (name -> dtype, shape,
    offsets; without its metadata), read without loading any tensor; `error` when it has none."""
    with open(path, "rb") as file:
        raw_size = file.read(8)
        if len(raw_size) != 8:
            raise error(f"{path} is not a safetensors file (shorter than its 8-byte header size)")
        (size,) = struct.unpack("<Q", raw_size)
        if size > os.path.getsize(path):
            raise error(f"{path} is truncated or not a safetensors file (header of {size} bytes)")
        head = file.read(size)
    try:
        parsed = json.loads(head)
    except ValueError as problem:
        raise error(f"{path} has an unreadable safetensors header: {problem}") from None
    parsed.pop("__metadata__", None)
    return raw_size + head, parsed


def write_safetensors(
    tensors: Mapping[str, tuple[str, Sequence[int], Bytes]], path: Path, metadata: dict[str, str] | None = None
) -> None:
    """`tensors` (name -> (safetensors dtype: F32, BF16, ...; shape; raw bytes as uint8, or a
    Chunked giving them a slice at a time)) as a safetensors file at `path`, each tensor's bytes
    written from where they lie. safetensors' own save_file builds the whole file in memory first: a
    GB more for a 0.5B model in bf16, faulted in at every full publish (seconds a GB on a VM)."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + int(data.nbytes)]}
        offset += int(data.nbytes)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format aligns the tensors' bytes to 8
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(head)) + head)
        for _, _, data in tensors.values():
            if isinstance(data, np.ndarray):
                file.write(data.data)
            else:
                for part in chunk_slices(data.nbytes):
                    file.write(data(part).data)


def apply(base_file: Path, deltas: Sequence[tuple[int, bytes]], out: Path, reuse: Path | None = None) -> None:
    """Write to `out` the weights of `base_file` with the `deltas` ((step, delta file bytes), oldest
    first, each against the one before it, the first against `base_file`) applied, a chunk at a
    time; raises DeltaError on a delta for other tensors or any chunk whose bytes fail its checksum.

    `reuse`: a file no one reads any more (an older rebuild), moved to `out` and written over where
    it exists: its pages are in memory already, where a new file's are faulted in on first write
    (seconds a GB on a VM: 0.6 s against up to 7 s for a 0.5B model's 988 MB here)."""
    raw_header, tensors = safetensors_header(base_file)
    read = [(step, *read_delta(data, f"the delta of step {step}")) for step, data in deltas]
    aliases = _aliases(read[0][1]) if read else {}
    _check_chain(base_file, tensors, read, aliases)
    end = len(raw_header) + max((entry["data_offsets"][1] for entry in tensors.values()), default=0)
    if base_file.stat().st_size < end:
        raise DeltaError(f"{base_file} is truncated: {base_file.stat().st_size} bytes, its header says {end}")
    # Where each chunk's blob starts, per delta.
    places = [
        {
            name: np.cumsum([spec["start"]] + [length for length, _ in spec["chunks"]]).tolist()
            for name, spec in header["tensors"].items()
            if name not in aliases
        }
        for _, header, _ in read
    ]
    pieces = [
        (name, index, part)
        for name, entry in tensors.items()
        if name not in aliases
        for index, part in enumerate(chunk_slices(entry["data_offsets"][1] - entry["data_offsets"][0]))
    ]
    # Where else each tensor's bytes go: the offsets of the names that are the same tensor.
    copies: dict[str, list[int]] = {}
    for name, first in aliases.items():
        copies.setdefault(first, []).append(tensors[name]["data_offsets"][0] - tensors[first]["data_offsets"][0])

    with ExitStack() as files:
        source = os.open(base_file, os.O_RDONLY)
        files.callback(os.close, source)
        target = _recycled(reuse, out)
        files.callback(os.close, target)

        def one(piece: tuple[str, int, slice]) -> None:
            name, index, part = piece
            begin = len(raw_header) + tensors[name]["data_offsets"][0] + part.start
            data = _scratch.take(part.stop - part.start)
            if os.preadv(source, [data.data], begin) != data.size:
                raise DeltaError(f"{base_file} is truncated in {name}")
            for (step, header, blobs), place in zip(read, places):
                length, xxh3 = header["tensors"][name]["chunks"][index]
                blob = blobs[place[name][index] : place[name][index] + length]
                try:
                    difference = _codec().decompress(blob, decompressed_size=data.size)
                except OSError as error:
                    raise DeltaError(f"the delta of step {step} is corrupt in {name}: {error}") from None
                xor_into(data, np.frombuffer(difference, dtype=np.uint8))
                if checksum(data) != xxh3:
                    raise DeltaError(
                        f"{name} rebuilt for step {step} fails its checksum: the delta was made against other "
                        "weights than it was applied to, or a file is corrupt"
                    )
            for shift in [0, *copies.get(name, [])]:
                os.pwrite(target, data.data, begin + shift)

        os.pwrite(target, raw_header, 0)
        _each(one, pieces)
        os.ftruncate(target, end)  # a reused file of another size


def _check_chain(
    base_file: Path, tensors: dict, read: Sequence[tuple[int, dict, memoryview]], aliases: dict[str, str]
) -> None:
    """Raises DeltaError unless every delta of a chain is for the tensors of `base_file` (the same
    names, sizes, chunking and ties as the chain's first)."""
    for step, header, _ in read:
        if _aliases(header) != aliases:
            raise DeltaError(
                f"the delta of step {step} ties other tensors together than the first delta of its chain ({aliases})"
            )
        if header["tensors"].keys() != tensors.keys():
            missing = sorted(header["tensors"].keys() ^ tensors.keys())[:5]
            raise DeltaError(f"the delta of step {step} is for other tensors than {base_file} holds: {missing}")
        if header.get("chunk") != CHUNK:
            raise DeltaError(
                f"the delta of step {step} is in chunks of {header.get('chunk')} bytes, this reader's are {CHUNK}"
            )
        for name, spec in header["tensors"].items():
            size = tensors[name]["data_offsets"][1] - tensors[name]["data_offsets"][0]
            if name in aliases:
                ok = aliases[name] in tensors and aliases[name] not in aliases and spec["size"] == size
                if not ok or header["tensors"][aliases[name]]["size"] != size:
                    raise DeltaError(f"the delta of step {step} has {name} the same as {aliases[name]}, which differs")
            elif spec["size"] != size or len(spec["chunks"]) != len(chunk_slices(size)):
                raise DeltaError(f"the delta of step {step} has {spec['size']} bytes of {name}, the base {size}")


def _aliases(header: dict) -> dict[str, str]:
    """A delta's names that are another tensor (`same_as`)."""
    return {name: spec["same_as"] for name, spec in header["tensors"].items() if "same_as" in spec}


def _recycled(reuse: Path | None, out: Path) -> int:
    """A descriptor for writing `out`: `reuse` moved there when it exists (its bytes all written over
    by apply, its length set), a new empty file otherwise."""
    if reuse is not None:
        try:
            os.replace(reuse, out)
        except FileNotFoundError:  # none, or another rebuild took it first
            pass
        else:
            return os.open(out, os.O_WRONLY)
    return os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
