"""A corpus of files as a whole, for the sources that read files (plugins/data/sources/files.py, stdlib.py): enough
text for a row of each split (check_amount), and a fingerprint of what is read (fingerprint_files)."""
from __future__ import annotations

import hashlib
from pathlib import Path

from plugins.data.packing import packed_stream
from plugins.data.reading import layout
from storage import file_hashes
from storage.fsio import digests


def check_amount(files: list[tuple[str, Path]], cfg) -> list[tuple]:
    """Enough text, after data.max_bytes and the held-out split, for one sequence in each split (packed), or one
    document in each (unpacked). Records' splits are known only once read: their bytes count by data.val_fraction."""
    d, seq = cfg.data, cfg.train.seq_len
    if not files:
        return [("data.paths", list(d.paths), "no text files found", "files or folders with *.txt, *.md or *.py files")]
    lay = layout(files, d.max_bytes, d.val_fraction)
    records = sum(p.size for p in lay.pieces if p.split is None)
    val = sum(p.size for p in lay.pieces if p.split == "val") + int(records * d.val_fraction)
    tokens = (lay.read_bytes - val, val)
    if packed_stream(d) and min(tokens) < seq + 1:
        which = "training" if tokens[0] < seq + 1 else "held-out"
        cut = bool(d.max_bytes) and lay.total_bytes > d.max_bytes  # what is not read for other reasons is not its
        return [("data.max_bytes" if cut else "data.paths", d.max_bytes if cut else list(d.paths),
                 f"the {which} split holds about {min(tokens)} tokens (of {lay.read_bytes} bytes read"
                 + (f", {lay.left_out:,} left out by data.max_bytes" if cut else "") + f", data.val_fraction="
                 f"{d.val_fraction}); one sequence needs train.seq_len+1 = {seq + 1}",
                 (f"data.val_fraction={min(0.5, round(2 * (seq + 1) / max(sum(tokens), 1), 4))}, "
                  if which == "held-out" else "") + ("data.max_bytes=0 (all of the corpus), " if cut else "")
                 + ("more text" + (f", or train.seq_len={min(tokens) - 1}" if min(tokens) > 2 else "")))]
    plain = {p.name: p.split for p in lay.pieces if p.split}
    if not packed_stream(d) and not records and len(set(plain.values())) < 2:
        return [("data.paths", list(d.paths), f"{len(plain)} document(s): each split needs one",
                 "more files, or data.packing=true")]
    return []


def fingerprint_files(files: list[tuple[str, Path]], max_bytes: int) -> str:
    """The content of the files read under data.max_bytes (a changed file, same size and time included), each
    hashed again only when its stamp changed (storage/file_hashes.py), several at once (fsio.digests)."""
    h = hashlib.sha256(f"{max_bytes}".encode())
    read = files[:layout(files, max_bytes, 0.5).files]
    for (name, _), digest in zip(read, digests([path for _, path in read], file_hashes.sha256)):
        h.update(f"{name}\0{digest}\n".encode())
    return h.hexdigest()[:16]
