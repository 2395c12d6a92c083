"""What a file's head says before launch, from its first SNIFF_BYTES (or an Arrow or Parquet file's schema): whether
it can be read as a text document (not_text), whether a records file gives a field of its records (field_missing).
The files source asks them of each file it reads (plugins/data/sources/files.py)."""
from __future__ import annotations

from pathlib import Path

from plugins.data.compressed import (PACKED, compression, decompress_errors, misnamed, open_decompressed, packed,
                                     suffix_of)
from plugins.data.piece_records import json_object, no_field
from plugins.data.reading import ARROW, JSON_LINES, arrow_fields, stream_closed
from plugins.data.unpack_advice import archive_advice, is_tar, unpack_advice

SNIFF_BYTES = 1 << 20  # how much of each file is checked for binary content and UTF-8 before launch


def field_missing(path: Path, field: str, by_record: bool = False) -> str:
    """Why a records file cannot give `field` of its records ('' when it can), from its head: the first
    SNIFF_BYTES of a JSON Lines file (the tokenize stage reads every line, naming file and line before publishing
    anything), a Parquet file's schema. by_record (data.format= a record format): a line that is not JSON, or lacks
    the field while others have it, is a bad record of its own, listed with the others (read_first_records); the
    file's fault is then a field that none of its head's records has (a wrong data.*_field)."""
    try:
        if suffix_of(path) in JSON_LINES:
            try:
                with (open_decompressed(path) if packed(path) else open(path, "rb")) as f:
                    head = f.read(SNIFF_BYTES)
            except decompress_errors() as e:
                return misnamed(path) or f"cannot be decompressed ({type(e).__name__}: {e}): it is damaged or cut short"
            if not packed(path) and (how := compression(head)):
                return (f"is {how}-compressed and its name does not say so; name it {path.name}"
                        f"{next(k for k, v in PACKED.items() if v == how)}, which is read as it decompresses")
            if suffix_of(path) == ".json" and head.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"["):
                return ("is a JSON array, not JSON Lines (one object per line), which the tokenize stage streams; "
                        f"write it as JSON Lines, e.g. jq -c '.[]' {path} > {path.with_suffix('.jsonl')}")
            lines = head.split(b"\n")
            lacking = ""
            for number, line in enumerate(lines[:-1] if len(head) == SNIFF_BYTES else lines, 1):
                if not line.strip():
                    continue
                try:
                    record = json_object(line)
                except ValueError as e:
                    if by_record:
                        continue
                    return f"line {number} {e}"
                if field not in record:
                    lacking = lacking or f"line {number} {no_field(field, record)}"
                    if not by_record:
                        return lacking
                elif by_record:
                    return ""
            return lacking
        if path.suffix in ARROW:
            if not stream_closed(path):
                return ("ends without the Arrow stream's end-of-stream marker: a write that did not finish (the "
                        "batches after the cut would be missing without a word)")
            keys = arrow_fields(path)
        else:
            import pyarrow.parquet as pq

            keys = pq.read_schema(path).names
    except OSError as e:
        return f"cannot be read ({e})"
    except Exception as e:  # pyarrow's ArrowInvalid: not a Parquet file or an Arrow stream
        return f"cannot be read as {'an Arrow IPC file or stream' if path.suffix in ARROW else 'Parquet'} ({e})"
    return "" if field in keys else no_field(field, keys)


def not_text(path: Path) -> str:
    """Why a file cannot be a text document ('' when it can), from its first SNIFF_BYTES."""
    try:
        with open(path, "rb") as f:
            head = f.read(SNIFF_BYTES)
    except OSError as e:
        return f"not readable ({e.strerror})"
    if not head:
        return "empty"
    if how := compression(head):
        return unpack_advice(path.name, head, how)
    if is_tar(head):
        return archive_advice(path.name)
    if b"\0" in head[:8192]:
        return "binary (NUL bytes)"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 3:  # not merely a character cut at the end of the sample
            return f"not UTF-8 (byte {e.start}: 0x{head[e.start]:02x})"
    return ""
