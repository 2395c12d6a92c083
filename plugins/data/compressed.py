"""Compressed JSON Lines (`.jsonl.gz`, `.json.zst`, `.jsonl.xz`, `.jsonl.bz2`: how c4, the Pile and Dolma ship) read as
they decompress, never whole in memory; a file cut short or damaged raises while read, zstd's included (its library's
stream reader returns what it has and says nothing); and their decompressed sizes, estimated."""
from __future__ import annotations

import contextlib
import functools
import io
import os
import zlib
from pathlib import Path
from typing import Iterator, Optional

from common.problem import InputFault

JSON_LINES = (".jsonl", ".json")  # .json: JSON Lines by another name (many Hub datasets)
PACKED = {".gz": "gzip", ".zst": "zstd", ".xz": "xz", ".bz2": "bz2"}  # compressed JSON Lines' last suffix
SIZE_SAMPLE = 1 << 22  # decompressed bytes read to estimate a compressed file's size


def _split(name: str) -> tuple[str, str]:
    """(stem, suffix) of a file name as pathlib splits it (no suffix for `.bashrc` or `x.`)."""
    i = name.rfind(".")
    return (name[:i], name[i:]) if 0 < i < len(name) - 1 else (name, "")


def _suffixes(path) -> tuple[str, str]:
    """(a file name's last suffix, the one before it), without building a Path: a plan asks this of every file of a
    corpus several times."""
    stem, suffix = _split(os.path.basename(os.fspath(path)))
    return suffix, _split(stem)[1]


def suffix_of(path) -> str:
    """A file's kind by its name: its suffix; compressed JSON Lines' (`x.jsonl.gz`), the one under the compression
    (other compressed files keep theirs: `.txt.gz` is not read)."""
    suffix, inner = _suffixes(path)
    return inner if suffix in PACKED and inner in JSON_LINES else suffix


def packed(path) -> bool:
    """Compressed JSON Lines (read as they decompress)."""
    suffix, inner = _suffixes(path)
    return suffix in PACKED and inner in JSON_LINES


def reads(name: str, suffixes: tuple[str, ...]) -> bool:
    """A file name of one of `suffixes`, or compressed JSON Lines of one of them."""
    return name.endswith(suffixes) or (packed(name) and suffix_of(name) in suffixes)


@contextlib.contextmanager
def open_decompressed(path) -> Iterator:
    """A compressed file's bytes as they decompress (never whole in memory)."""
    with open(path, "rb") as raw:
        yield decompressing(raw, PACKED[Path(path).suffix])


def decompressing(source, how: str):
    """A reader of `source`'s bytes decompressed (it leaves `source` open)."""
    if how == "gzip":
        import gzip

        return gzip.GzipFile(fileobj=source)
    if how == "xz":
        import lzma

        return lzma.LZMAFile(source)
    if how == "bz2":
        import bz2

        return bz2.BZ2File(source)
    return io.BufferedReader(_ZstdFrames(source), 1 << 20)


class _ZstdFrames(io.RawIOBase):
    """zstd's frames one after another (as `zstd -d` reads them; with the windows `zstd --long` writes), a frame cut
    short an EOFError, as gzip's: zstandard's own stream reader returns what it has and says nothing."""
    READ = 1 << 13  # compressed bytes fed at a time: what one call may expand to stays small

    def __init__(self, source):
        import zstandard

        self.source, self.zstd, self.frame, self.left = source, zstandard, None, b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while not self.left:
            data = self.source.read(self.READ)
            if not data:
                if self.frame is not None and not self.frame.eof:
                    raise EOFError("the file ends inside a zstd frame")
                return 0
            while data:
                if self.frame is None or self.frame.eof:
                    self.frame = self.zstd.ZstdDecompressor(max_window_size=1 << 31).decompressobj()
                self.left += self.frame.decompress(data)
                data = self.frame.unused_data if self.frame.eof else b""
        n = min(len(buffer), len(self.left))
        buffer[:n], self.left = self.left[:n], self.left[n:]
        return n


def decompress_errors() -> tuple[type, ...]:
    """What a damaged or cut compressed file raises while read (gzip: BadGzipFile, an OSError, or EOFError at a cut;
    zlib.error; lzma.LZMAError; zstandard.ZstdError)."""
    import lzma

    import zstandard

    return OSError, EOFError, zlib.error, lzma.LZMAError, zstandard.ZstdError


MAGIC = ((b"\x1f\x8b", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"\xfd7zXZ\x00", "xz"), (b"BZh", "bz2"))  # first bytes


def compression(head: bytes) -> str:
    """The compression a file's first bytes show ('' for none)."""
    return next((name for magic, name in MAGIC if head.startswith(magic)), "")


def misnamed(path) -> str:
    """Why a file named as compressed does not hold its name's compression ('' when it does, or cannot be read: its
    reader says why), with the rename that fixes it: a plain file called .jsonl.gz is misnamed, not damaged."""
    path = os.fspath(path)
    stem, suffix = os.path.splitext(path)
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        return ""
    said, found = PACKED.get(suffix), compression(head)
    if said is None or found == said:
        return ""
    target = stem + next(k for k, v in PACKED.items() if v == found) if found else stem
    what = f"{found}-compressed" if found else "plain text" if _text(head) else "no compression's first bytes"
    return (f"is not {said}-compressed, though its name says {suffix}: it holds {what}; rename it: mv {path} "
            f"{target} (and name that in data.paths)")


def _text(head: bytes) -> bool:
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start >= len(head) - 3  # a character cut at the end of the sample
    return b"\0" not in head


def damaged(path, e: BaseException) -> InputFault:
    """A file that does not decompress: misnamed (renamed, it reads), else damaged or cut short."""
    if why := misnamed(path):
        rule, _, fix = why.partition("; ")
        return InputFault(f"{path}: {rule}; fix: {fix}")
    return InputFault(f"{path}: cannot be decompressed ({type(e).__name__}: {e}); "
                      "fix: the file is damaged or cut short: fetch it again, or remove it from data.paths")


class _Counted(io.RawIOBase):
    """A file that counts the bytes read from it (what a decompressor has consumed)."""

    def __init__(self, f):
        self.f, self.count = f, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self.f.readinto(buffer)
        self.count += n or 0
        return n


@functools.lru_cache(maxsize=65536)
def packed_size(path: str, size: int, mtime_ns: int) -> int:
    """A compressed file's decompressed size: exact where it decompresses whole within SIZE_SAMPLE bytes, else its
    size times the ratio of its first SIZE_SAMPLE decompressed bytes to the compressed bytes they took (cached by
    the file's stamp: the checks, the fingerprint and the tokenize stage lay the corpus out more than once)."""
    try:
        with open(path, "rb") as raw:
            counted = _Counted(raw)
            f = decompressing(io.BufferedReader(counted, 1 << 16), PACKED[Path(path).suffix])
            out = 0
            while out < SIZE_SAMPLE and (block := f.read(min(1 << 20, SIZE_SAMPLE - out))):
                out += len(block)
            if out < SIZE_SAMPLE or not f.read(1):
                return out
            return round(out * size / max(counted.count, 1))
    except decompress_errors():  # said by the checks (`field_missing` reads its head), or by the tokenize stage
        return size


def decompressed_lines(path, end: Optional[int] = None, block: int = 1 << 20) -> Iterator[tuple[int, bytes]]:
    """(offset in the decompressed text, line) of the lines that start before `end` (None: all of them),
    decompressed `block` bytes at a time; damage a ValueError naming the file."""
    at, rest = 0, []
    try:
        with open_decompressed(path) as f:
            while data := f.read(block):
                *lines, tail = data.split(b"\n")
                if lines:
                    lines[0], rest = b"".join(rest) + lines[0], []
                rest.append(tail)
                for line in lines:
                    if end is not None and at >= end:
                        return
                    yield at, line
                    at += len(line) + 1
    except decompress_errors() as e:
        raise damaged(path, e) from None
    if (end is None or at < end) and (last := b"".join(rest)):
        yield at, last
