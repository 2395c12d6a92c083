"""Hugging Face's sharded safetensors layout: written from a stream of tensors, read one tensor at a time.

  <stem>.safetensors                          when everything fits in one shard (as save_pretrained does)
  <stem>-00001-of-00003.safetensors, ...      otherwise, each at most `max_shard_bytes` (a larger tensor alone)
  <stem>.safetensors.index.json               {"metadata": {"total_size": ...}, "weight_map": {name: file}}

The format (an 8-byte header length, a JSON header of names, dtypes, shapes and byte offsets, then the bytes) is
written here rather than by safetensors' save_file, which needs a whole file's tensors in memory: the header is
known before any tensor is made, so tensors stream into the file a few at a time and memory is bounded by
READ_BYTES and the largest tensor, whatever the model and the shard size. Each tensor is read back from the file,
where the header on disk places it, and compared byte for byte with what was written while that is still in
memory; safetensors itself then parses each finished shard's header.
`Reader` opens either layout (and a folder of any *.safetensors files, as users' Hugging Face folders come) and
copies out one tensor per call.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Optional

import torch
from safetensors import safe_open

from storage.fsio import KnownHashes, atomic_write_json

INDEX = ".safetensors.index.json"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
_NAMES = {v: k for k, v in _DTYPES.items()}
READ_BYTES = 64 * 2**20  # tensors made (read from a checkpoint) in one go, at most: the writer's working memory


@dataclass(frozen=True)
class Entry:
    """A tensor to write: its name, shape and dtype (known before it is made) and how to make it."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Optional[Callable[[], torch.Tensor]] = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def file_names(stem: str, shards: int) -> list[str]:
    if shards == 1:
        return [f"{stem}.safetensors"]
    return [f"{stem}-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]


def group(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    """save_pretrained's rule: entries in order fill a group until the next would overflow it (a larger one alone)."""
    groups: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if groups[-1] and size + e.nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += e.nbytes
    return groups


def write(folder: Path, stem: str, entries: list[Entry], max_shard_bytes: int, metadata: Optional[dict] = None,
          read: Optional[Callable[[list[Entry]], dict[str, torch.Tensor]]] = None,
          read_bytes: int = READ_BYTES, known: Optional[KnownHashes] = None) -> dict:
    """Write the entries as one file or several plus an index. Tensors are made a few at a time (read: how a group of
    at most read_bytes is made in one go; default each entry's make()) and streamed into the file under a header
    written first, so memory holds a group, never a shard. Each group is read back from the file and compared byte
    for byte with what was written (no checksum pass over either side: at 0.2B the two CRC-32 passes were as
    long as the write itself). known: given the sha256 of each file, taken from its bytes as they were written (the
    stage's cache entry then reads none of them back to hash it). Returns {files, tensors, bytes}."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shards = group(entries, max_shard_bytes)
    names = file_names(stem, len(shards))
    meta = {k: str(v) for k, v in (metadata or {}).items()}
    for shard, name in zip(shards, names):
        _write_shard(folder / name, shard, meta, read or (lambda g: {e.name: e.make() for e in g}), read_bytes,
                     known)
    weight_map = {e.name: name for shard, name in zip(shards, names) for e in shard}
    total = sum(e.nbytes for e in entries)
    if len(shards) > 1:
        atomic_write_json(folder / f"{stem}{INDEX}", {"metadata": {"total_size": total, **meta},
                                                       "weight_map": weight_map})
    return {"files": names, "tensors": len(weight_map), "bytes": total}


def _write_shard(path: Path, entries: list[Entry], metadata: dict, read, read_bytes: int,
                 known: Optional[KnownHashes]) -> None:
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": _NAMES[e.dtype], "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        head = struct.pack("<Q", len(raw)) + raw
        f.write(head)
        digest.update(head)
        f.flush()
        back = Reader(path.parent, path.name.removesuffix(".safetensors"))  # where the header on disk puts each
        for batch in group(entries, read_bytes):
            tensors = read(batch)
            for e in batch:
                t = tensors[e.name]
                if tuple(t.shape) != tuple(e.shape) or t.dtype != e.dtype:
                    raise RuntimeError(f"{e.name}: made {tuple(t.shape)} {t.dtype}, planned {e.shape} {e.dtype}")
                data = memoryview(_bytes(t).numpy())
                digest.update(data)  # in file order: the header, then each tensor as laid out
                f.write(data)
            f.flush()
            for e in batch:  # read back while the batch is in memory: a byte comparison, no checksum of either side
                if not torch.equal(_bytes(back[e.name]), _bytes(tensors.pop(e.name))):
                    raise RuntimeError(f"{path.name}: {e.name} read back differs from what was written")
            del tensors
        os.fsync(f.fileno())
    if known is not None:
        known.add(path, digest.hexdigest())
    with safe_open(str(path), framework="numpy") as f:  # the library parses the header (no tensor is read)
        if set(f.keys()) != {e.name for e in entries}:
            raise RuntimeError(f"{path.name}: safetensors reads "
                               f"{sorted(set(f.keys()) ^ {e.name for e in entries})[:5]} unexpectedly")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shape, dtype and bytes (a NaN equals the same NaN)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bytes(a), _bytes(b))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def exists(folder: Path, stem: str) -> bool:
    folder = Path(folder)
    return (folder / f"{stem}.safetensors").is_file() or (folder / f"{stem}{INDEX}").is_file()


class Reader(Mapping[str, torch.Tensor]):
    """The tensors of `<stem>.safetensors`, or of a sharded set through its index; with stem=None every
    *.safetensors file of the folder. `reader[name]` reads one tensor's bytes into a new tensor; shapes come from
    the headers. Files are read, not mapped: safetensors' safe_open maps a whole file, and every page a read
    touches stays resident in the process until the handle closes (a model's worth, by the last tensor)."""

    def __init__(self, folder: Path, stem: Optional[str] = "model"):
        folder = Path(folder)
        self.folder = folder
        if stem is not None and (folder / f"{stem}{INDEX}").is_file():
            index = json.loads((folder / f"{stem}{INDEX}").read_text())
            files = sorted(set(index["weight_map"].values()))
        elif stem is not None:
            files = [f"{stem}.safetensors"]
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        missing = [f for f in files if not (folder / f).is_file()]
        if missing or not files:
            raise FileNotFoundError(f"{folder}: no safetensors file{' ' + missing[0] if missing else 's'}"
                                    f"{f' of {stem!r}' if stem else ''}")
        self.files = files
        self._metadata: dict = {}
        self._where: dict[str, tuple[str, torch.dtype, tuple[int, ...], int, int]] = {}
        for f in files:
            header, start = read_header(folder / f)
            if not self._metadata:
                self._metadata = header.pop("__metadata__", None) or {}
            header.pop("__metadata__", None)
            for name, info in header.items():
                begin, end = info["data_offsets"]
                self._where[name] = (f, _DTYPES[info["dtype"]], tuple(info["shape"]), start + begin, end - begin)

    def __getitem__(self, name: str) -> torch.Tensor:
        file, dtype, shape, offset, size = self._where[name]
        tensor = torch.empty(shape, dtype=dtype)
        with open(self.folder / file, "rb") as f:
            f.seek(offset)
            if size and f.readinto(_bytes(tensor).numpy()) != size:
                raise OSError(f"{self.folder / file}: {name} is cut short (the file is truncated)")
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name: object) -> bool:  # Mapping's would read the tensor to find out
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name][2]

    def dtype(self, name: str) -> torch.dtype:
        return self._where[name][1]

    def metadata(self) -> dict:
        return self._metadata


def read_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header and where its data starts."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length)), 8 + length


def entries_of(tensors: Mapping[str, torch.Tensor], names: Optional[Iterable[str]] = None) -> list[Entry]:
    """Entries for tensors in memory, or a Reader's (read when written)."""
    out = []
    for k in (list(names) if names is not None else list(tensors)):
        if isinstance(tensors, Reader):
            out.append(Entry(k, tuple(tensors.shape(k)), tensors.dtype(k), lambda k=k: tensors[k]))
        else:
            out.append(Entry(k, tuple(tensors[k].shape), tensors[k].dtype, lambda k=k: tensors[k]))
    return out
