"""A compressed file that is not JSON Lines is not read: the command that makes files of it that are. A tar archive
(`corpus.tar.gz`, `corpus.tar`) is unpacked with tar: gunzip would leave a tar, which is read no better."""
from __future__ import annotations

import io

from plugins.data.compressed import decompress_errors, decompressing

DECOMPRESS = {"gzip": "gunzip -k", "zstd": "zstd -d", "xz": "unxz -k", "bz2": "bunzip2 -k"}
UNTAR = {"": "tar -xf", "gzip": "tar -xzf", "zstd": "tar --zstd -xf", "xz": "tar -xJf", "bz2": "tar -xjf"}
TAR_BLOCK = 512  # a tar archive's first header block: "ustar" at byte 257 (POSIX and GNU tar)


def is_tar(block: bytes) -> bool:
    return block[257:262] == b"ustar"


def unpack_advice(name: str, head: bytes, how: str) -> str:
    """Why a file compressed with `how` (its first bytes: `head`) is not read, and what to run."""
    if is_tar(_inner(head, how)):
        return archive_advice(name, how)
    return (f"{how}-compressed, which the tokenize stage reads for JSON Lines only (x.jsonl.gz); decompress it "
            f"beside: {DECOMPRESS[how]} {name}")


def archive_advice(name: str, how: str = "") -> str:
    kind = f"a {how}-compressed tar archive" if how else "a tar archive"
    return (f"{kind}, whose files the tokenize stage does not read inside it; unpack it: {UNTAR[how]} {name}, and "
            "name the folder of its files in data.paths")


def _inner(head: bytes, how: str) -> bytes:
    """The first TAR_BLOCK bytes under the compression (b'' where the head does not decompress that far)."""
    try:
        return decompressing(io.BytesIO(head), how).read(TAR_BLOCK)
    except decompress_errors():
        return b""
