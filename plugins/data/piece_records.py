"""Reading one piece of a corpus (plugins/data/reading.py lays the pieces out): a text piece's bytes, a records
piece's records (JSON Lines, compressed or not, Parquet row groups, Arrow record batches), each named by where it is
(file and line, or row), its fields' values taken by their type: text is a string or UTF-8 bytes, never a value's
Python spelling."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator, Optional

from common.problem import InputFault
from plugins.data.compressed import decompressed_lines, open_decompressed, packed
from plugins.data.reading import RECORD_BATCH, Piece, arrow_batches, arrow_fields, in_val


def piece_bytes(piece: Piece) -> tuple[int, bytes]:
    """(offset, bytes) of the lines that start in [piece.start, piece.end) of a text or JSON Lines file."""
    with open(piece.path, "rb") as f:
        start = piece.start if piece.start == piece.cut else _line_start(f, piece.start)
        end = piece.end if piece.end == piece.cut else _line_start(f, piece.end)
        if piece.cut >= 0:  # neither part of a lone file reads across its held-out cut
            start, end = (start, min(end, piece.cut)) if piece.start < piece.cut else (max(start, piece.cut), end)
        f.seek(start)
        return start, f.read(max(0, end - start))


def _line_start(f, at: int) -> int:
    """The first line start at or after byte `at`."""
    if at <= 0:
        return 0
    f.seek(at - 1)
    if f.read(1) in (b"\n", b""):
        return at
    return at + len(f.readline())


def documents(piece: Piece, text_field: str, val_fraction: float) -> Iterator[tuple[str, bytes, bool, object]]:
    """(split, text, closes its document, where it is) of a piece: a text piece whole (where: its file), or each
    record of a records piece."""
    if piece.kind == "text":
        _, data = piece_bytes(piece)
        yield piece.split, data, piece.closes, piece.path
        return
    for split, record, where in records(piece, {"text_field": text_field}, val_fraction):
        text = text_value(record["text_field"], where, "text_field", text_field)
        if text:  # an empty record is no document
            yield split, text, True, where


def record_fields(data_cfg) -> dict[str, str]:
    """The fields a record is read from, by the data key that names each (its data.format's)."""
    from plugins.data.formats.spec import format_of

    return format_of(data_cfg).fields(data_cfg)


class Where:
    """Where a record is, for a message: its file and line (JSON Lines, from the line's offset: counted only when
    printed) or row (Parquet, Arrow)."""

    def __init__(self, path, line_start: Optional[int] = None, row: Optional[int] = None):
        self.path, self.line_start, self.row = path, line_start, row

    def __str__(self) -> str:
        if self.line_start is not None:
            return f"{self.path}: line {line_number(self.path, self.line_start)}"
        return f"{self.path}: row {self.row}"


class BadRecord(InputFault):
    """A fault of one record's own (a line that is not JSON, a field missing or of the wrong type, a pair with
    nothing to compare, a conversation the template cannot render), not of a setting: data.bad_records decides
    whether it is refused or left out (plugins/data/bad_records.py)."""


def records(piece: Piece, fields: dict[str, str], val_fraction: float, optional: Optional[dict[str, str]] = None,
            keep_bad: bool = False) -> Iterator[tuple[str, dict, Where]]:
    """(split, {key: the value of its field}, where it is) of each record of a JSON Lines or Parquet piece; fields
    maps the data keys that name fields (text_field, prompt_field, ...) to the names. The split comes from the
    record's name (file and line, or file and row). A record without one of the fields (or a line that is not JSON)
    is refused, naming file and line (keep_bad: its BadRecord is yielded in its place, and reading goes on); one
    without an `optional` field (data.tools_field) has None there."""
    optional = optional or {}
    if piece.kind == "jsonl":
        for line_start, record in _json_records(piece, keep_bad):
            where = Where(piece.path, line_start)
            missing = None if isinstance(record, BadRecord) else \
                next((k for k, f in fields.items() if f not in record), None)
            if missing is not None:
                record = BadRecord(f"{where} {no_field(fields[missing], record)}; fix: data.{missing}= the field "
                                   "that holds it, or repair the record")
                if not keep_bad:
                    raise record
            yield (_split(f"{piece.name}@{line_start}", val_fraction), record if isinstance(record, BadRecord) else
                   {**{k: record.get(f) for k, f in optional.items()}, **{k: record[f] for k, f in fields.items()}},
                   where)
    elif piece.kind != "text":
        present = set() if not optional else set(arrow_fields(Path(piece.path)) if piece.kind == "arrow" else
                                                  _parquet_fields(piece.path))
        columns = {**{k: f for k, f in optional.items() if f in present}, **fields}
        for row, values in enumerate(_rows(piece, tuple(dict.fromkeys(columns.values()))), piece.first_row):
            yield (_split(f"{piece.name}#{row}", val_fraction),
                   {**{k: None for k in optional}, **{k: values[f] for k, f in columns.items()}},
                   Where(piece.path, row=row))


def _parquet_fields(path: str) -> list[str]:
    import pyarrow.parquet as pq

    return pq.read_schema(path).names


def text_value(value, where, key: str, field: str) -> bytes:
    """A field's text as the UTF-8 a document holds: a string; a binary value (a Parquet or Arrow binary column) that
    is strict UTF-8; null is no text. Anything else (a number, a list, an object, bytes that are not UTF-8) is
    refused naming the record, the field and what it holds: never turned into text, which would train on its
    Python spelling ("[{'role': ...}]", "b'...'")."""
    if value is None:
        return b""
    if isinstance(value, str):
        try:
            return value.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate, which JSON's \ud800 escapes allow
            raise InputFault(f"{where}: the field {field!r} (data.{key}) holds a string that is not valid Unicode "
                             f"({e.reason} at character {e.start}); fix: repair the record") from None
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputFault(f"{where}: the field {field!r} (data.{key}) is binary and not UTF-8 text (byte {e.start}: "
                             f"0x{data[e.start]:02x}); fix: store the text as a string column, or decode it to "
                             "UTF-8") from None
        return data
    raise InputFault(f"{where}: the field {field!r} (data.{key}) holds {kind_of(value)}, not text: "
                     f"{preview(value)}; fix: data.{key}= a field that holds text, or repair the record")


def kind_of(value) -> str:
    """What a JSON or Arrow value is, in words ('a list', 'a number', ...)."""
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return f"a value of type {type(value).__name__}"


def preview(value, limit: int = 120) -> str:
    """A value as JSON, cut to `limit` characters, for a message."""
    try:
        text = json.dumps(value, ensure_ascii=False, default=repr)
    except ValueError:
        text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _split(name: str, val_fraction: float) -> str:
    return "val" if in_val(name, val_fraction) else "train"


def _rows(piece: Piece, fields: tuple[str, ...]) -> Iterator[dict]:
    """The values of `fields` in a Parquet row group or a run of an Arrow stream's record batches, row by row; a
    page or batch that cannot be read (corrupt, truncated) is a ValueError naming the file and where in it."""
    import pyarrow as pa

    try:
        yield from _rows_of(piece, fields)
    except (OSError, pa.ArrowException) as e:  # pyarrow's own words name no file ("Corrupt snappy compressed data.")
        where = f"row group {piece.start}" if piece.kind == "parquet" else f"record batches {piece.start}-{piece.end}"
        raise InputFault(f"{piece.path}: {where} (rows from {piece.first_row}) cannot be read ({type(e).__name__}: "
                         f"{e}); fix: repair the file or remove it from data.paths") from None


def _rows_of(piece: Piece, fields: tuple[str, ...]) -> Iterator[dict]:
    if piece.kind == "parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(piece.path).iter_batches(batch_size=RECORD_BATCH, row_groups=[piece.start],
                                                             columns=list(fields)):
            yield from batch.to_pylist()
        return
    import pyarrow as pa

    with pa.memory_map(piece.path) as source:
        for i, batch in enumerate(arrow_batches(source)):
            if i >= piece.end:
                break
            if i >= piece.start:
                yield from batch.select(list(fields)).to_pylist()


def json_object(line: bytes) -> dict:
    """A JSON Lines record; ValueError saying why a line is not one (the caller names file and line)."""
    try:
        record = json.loads(line)
    except ValueError as e:
        raise ValueError(f"is not JSON ({e})") from None
    if not isinstance(record, dict):
        raise ValueError(f"is not a JSON object (a {type(record).__name__})")
    return record


def no_field(field: str, keys) -> str:
    return f"has no field {field!r} (its fields: {', '.join(keys) or 'none'})"


def _lines(piece: Piece) -> Iterator[tuple[int, bytes]]:
    """(offset, line) of the lines that start in a JSON Lines piece."""
    if packed(piece.path):
        yield from decompressed_lines(piece.path, None if piece.to_end else piece.end)
        return
    offset, data = piece_bytes(piece)
    at = 0
    for line in data.split(b"\n"):
        yield offset + at, line
        at += len(line) + 1


def _json_records(piece: Piece, keep_bad: bool = False) -> Iterator[tuple[int, dict]]:
    """(offset, record) of each line of a JSON Lines piece; a line that is not a JSON object is refused (keep_bad:
    yielded as its BadRecord)."""
    for line_start, line in _lines(piece):
        if not line.strip():
            continue
        try:
            record = json_object(line)
        except ValueError as e:
            record = BadRecord(f"{piece.path}: line {line_number(piece.path, line_start)} {e}; fix: repair the line "
                               "(one JSON object per line), or remove it")
            if not keep_bad:
                raise record from None
        yield line_start, record


_counted: dict = {}  # (path, its stamp) -> (an offset, the line that starts there): the last line_number's count


def line_number(path: str, offset: int) -> int:
    """The line that starts at byte `offset` (counted only when a message needs it). Counting goes on from the last
    offset counted in the same file where it is not past `offset` (bad records are named in file order, data.
    bad_records=skip names each one of them: without it a file of many would be counted again from its start for
    each)."""
    try:
        stat = os.stat(path)
        stamp = (str(path), stat.st_mtime_ns, stat.st_size)
    except OSError:
        stamp = None
    done, count = _counted.get(stamp, (0, 1))
    if done > offset or packed(path):  # (a compressed file cannot seek: counted from its start)
        done, count = 0, 1
    with (open_decompressed(path) if packed(path) else open(path, "rb")) as f:
        if done:
            f.seek(done)
        while done < offset:
            block = f.read(min(1 << 24, offset - done))
            if not block:
                break
            count += block.count(b"\n")
            done += len(block)
    if stamp is not None:
        _counted.clear()  # one file's count kept: the one being read
        _counted[stamp] = (done, count)
    return count
