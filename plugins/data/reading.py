"""Reading a corpus of files as a stream: the files cut into pieces, each piece read on its own, in bounded memory.

A piece is a byte range of a text or JSON Lines file (the lines that start inside it), one row group of a Parquet
file, or a run of record batches of an Arrow stream (a Hugging Face `datasets` folder written by `save_to_disk`).
The cuts depend only on the files (every CHUNK_BYTES, at the next line start), never on how many tasks read them,
so N tasks that each take a contiguous run of pieces write, part after part, exactly what one task writes.

Which split a document belongs to is decided by its name, as before: a plain text file is one document, named by
its path in the corpus (a lone file holds out its last data.val_fraction, cut at a line start); a record of a JSON
Lines or Parquet file is one document, named `<file>@<byte offset>` or `<file>#<row>`.

Compressed JSON Lines (`.jsonl.gz`, `.json.zst`, `.jsonl.xz`, `.jsonl.bz2`: how c4, the Pile and Dolma ship) are read
as they decompress, a block at a time: one piece per file (a compressed stream has no byte to start at but its
first), its records named by their offsets in the decompressed text, as the same file decompressed would name them.
Its size is an estimate (the first SIZE_SAMPLE bytes decompressed), used for data.max_bytes's choice of files, the
tasks' shares and the progress; a file chosen whole is read to its end whatever the estimate.
"""
from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from common.problem import InputFault
from plugins.data.compressed import (JSON_LINES, decompressed_lines, open_decompressed, packed, packed_size,
                                     suffix_of)

CHUNK_BYTES = 1 << 20      # a piece of a text or JSON Lines file: what one read holds (plus the line it ends in)
RECORD_BATCH = 256         # Parquet rows read at a time
ARROW = (".arrow", ".feather")  # Arrow IPC: datasets' files and streams; Feather v2 is the IPC file format
RECORDS = (".jsonl", ".json", ".parquet", *ARROW)  # .json: JSON Lines by another name (many Hub datasets)


@dataclass(frozen=True)
class Piece:
    name: str                # the file's name in the corpus (its split and its records' names derive from it)
    path: str
    kind: str                # text | jsonl | parquet | arrow
    start: int               # text, jsonl: the lines starting in [start, end); parquet: row group `start`;
                             # arrow: the record batches [start, end) of the stream
    end: int
    size: int                # bytes (Parquet: the row group's share of the file), for partitions and progress
    split: Optional[str]     # text: the piece's split; records: None (each record's own name decides)
    closes: bool = True      # text: the piece ends its document in its split (an <eos> follows it)
    first_row: int = 0       # parquet, arrow: the piece's first row in the file
    to_end: bool = False     # compressed JSON Lines read whole: to the file's end, whatever `end` estimated
    opens: bool = True       # text: the piece starts its document (a <bos> goes before it, where the tokenizer has one)
    cut: int = -1            # a lone text file: the byte where its held-out part starts (no piece reads across it)


@dataclass(frozen=True)
class Layout:
    """The pieces of a corpus under data.max_bytes, and what that leaves out."""
    pieces: list[Piece]
    files: int               # files read (wholly or in part)
    read_bytes: int
    total_bytes: int         # of every file of the corpus
    total_files: int
    named_twice: int = 0     # paths that named a file already named (read once)

    @property
    def left_out(self) -> int:
        return self.total_bytes - self.read_bytes


def in_val(name: str, val_fraction: float) -> bool:
    """The held-out split takes the names whose hash falls under val_fraction (stable as the corpus grows)."""
    return zlib.crc32(name.encode()) % 10_000 < val_fraction * 10_000


def assign(names: list[str], val_fraction: float) -> tuple[list[int], list[int]]:
    """Indices of the train and held-out documents, by name, never leaving a split empty with two or more."""
    train, val = [], []
    for i, name in enumerate(names):
        (val if in_val(name, val_fraction) else train).append(i)
    if not val and len(train) > 1:
        val.append(train.pop())
    if not train and len(val) > 1:
        train.append(val.pop(0))
    return train, val


def layout(files: list[tuple[str, Path]], max_bytes: int, val_fraction: float) -> Layout:
    """The pieces of `files` ((name, path), in corpus order) holding their first max_bytes (0: all). Only sizes
    and Parquet footers are read."""
    sizes = [(name, Path(path), _size(Path(path))) for name, path in files]
    total = sum(s for *_, s in sizes)
    chosen, budget = [], max_bytes or total
    for name, path, size in sizes:
        if budget <= 0:
            break
        chosen.append((name, path, min(size, budget), size))
        budget -= size
    plain = [name for name, path, *_ in chosen if suffix_of(path) not in RECORDS]
    lone = len(chosen) == 1 and bool(plain)
    train, _ = assign(plain, val_fraction)
    train_names = {plain[i] for i in train}
    pieces: list[Piece] = []
    for name, path, read, size in chosen:
        if path.suffix == ".parquet":
            pieces += _row_groups(name, path, read)
        elif path.suffix in ARROW:
            pieces += _batch_runs(name, path, read)
        elif packed(path):
            pieces.append(Piece(name, str(path), "jsonl", 0, read, read, None, to_end=read >= size))
        elif path.suffix in JSON_LINES:
            pieces += [Piece(name, str(path), "jsonl", a, b, b - a, None) for a, b in _grid(read)]
        elif lone:
            cut = held_out_cut(path, int(read * (1 - val_fraction)) + 1, read)
            pieces += [Piece(name, str(path), "text", a, b, b - a, "train", b == cut, opens=a == 0, cut=cut)
                       for a, b in _grid(cut)]
            pieces += [Piece(name, str(path), "text", a, b, b - a, "val", b == read, opens=a == cut, cut=cut)
                       for a, b in _grid(read, start=cut)]
        else:
            split = "train" if name in train_names else "val"
            pieces += [Piece(name, str(path), "text", a, b, b - a, split, b == read, opens=a == 0)
                       for a, b in _grid(read)]
    return Layout(pieces, len(chosen), sum(p.size for p in pieces), total, len(files),
                  getattr(files, "named_twice", 0))


SCAN_BYTES = 1 << 20  # how far past the held-out cut a line start is looked for


def held_out_cut(path: Path, target: int, read: int) -> int:
    """Where a lone text file's held-out part starts: the first line start at or after `target`, else (a file of
    one long line, or a last line longer than SCAN_BYTES) `target` itself, moved to a character's first byte: the
    document is split by position, as nanoGPT splits its one text, rather than leave the held-out part empty."""
    if target >= read:
        return read
    with open(path, "rb") as f:
        f.seek(target - 1)
        window = f.read(min(SCAN_BYTES, read - target + 1))
        newline = window.find(b"\n")
        if 0 <= newline and target + newline < read:
            return target + newline
        f.seek(target)
        head = f.read(4)
    return target + next((k for k, b in enumerate(head) if b & 0xC0 != 0x80), len(head))


def _size(path: Path) -> int:
    """A file's bytes of corpus: its size; an Arrow stream's, its record batches' (the schema and each batch's
    metadata are no corpus: counted, they would read as bytes data.max_bytes left out); a Parquet file's, its rows
    at the Arrow bytes per row of its first row group that has rows (its size on disk is compressed and dictionary-
    encoded, tenfold less than its text: a held-out split estimated from it refused legal train.eval_batches; one row
    group read, as the tokenize stage reads them); compressed JSON Lines', an estimate (`packed_size`)."""
    if packed(path):
        stat = path.stat()
        return packed_size(str(path), stat.st_size, stat.st_mtime_ns)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(path)
            meta = parquet.metadata
            first = next((g for g in range(meta.num_row_groups) if meta.row_group(g).num_rows), None)
            if first is None:
                return path.stat().st_size
            return round(parquet.read_row_group(first).nbytes * meta.num_rows / meta.row_group(first).num_rows)
        except (OSError, ValueError):  # the checks say what is wrong with it (pyarrow's ArrowInvalid is one)
            return path.stat().st_size
    if path.suffix not in ARROW:
        return path.stat().st_size
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            return sum(batch.nbytes for batch in arrow_batches(source))
    except (OSError, pa.ArrowInvalid):  # the checks say what is wrong with it
        return path.stat().st_size


def _grid(end: int, start: int = 0) -> list[tuple[int, int]]:
    """[start, end) cut every CHUNK_BYTES of the file (the same cuts whatever the range)."""
    cuts = [start] + [k * CHUNK_BYTES for k in range(start // CHUNK_BYTES + 1, -(-end // CHUNK_BYTES))] + [end]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def _row_groups(name: str, path: Path, read: int) -> list[Piece]:
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    size, rows, pieces, row, taken = _size(path), max(meta.num_rows, 1), [], 0, 0
    for g in range(meta.num_row_groups):
        n = meta.row_group(g).num_rows
        share = max(1, size * n // rows) if n else 0  # a row group of no rows holds no corpus
        if taken >= read:
            break
        pieces.append(Piece(name, str(path), "parquet", g, g + 1, share, None, first_row=row))
        row, taken = row + n, taken + share
    return pieces


def _batch_runs(name: str, path: Path, read: int) -> list[Piece]:
    """An Arrow stream's record batches in runs of about CHUNK_BYTES (read through a memory map: no copy)."""
    import pyarrow as pa

    pieces, first, row, run_rows, run_bytes, taken, batches = [], 0, 0, 0, 0, 0, 0
    with pa.memory_map(str(path)) as source:
        for batch in arrow_batches(source):
            batches += 1
            run_rows, run_bytes = run_rows + batch.num_rows, run_bytes + batch.nbytes
            if run_bytes >= CHUNK_BYTES:
                pieces.append(Piece(name, str(path), "arrow", first, batches, run_bytes, None, first_row=row))
                first, row, taken, run_rows, run_bytes = batches, row + run_rows, taken + run_bytes, 0, 0
                if taken >= read:
                    return pieces
    if run_rows:
        pieces.append(Piece(name, str(path), "arrow", first, batches, run_bytes, None, first_row=row))
    return pieces


ARROW_FILE_MAGIC = b"ARROW1"  # an Arrow IPC file (Feather v2) starts and ends with it; a stream has none


def _arrow_reader(source):
    """An Arrow IPC reader of a memory-mapped file: the file format (Feather v2, random access) or a stream."""
    import pyarrow as pa

    head = source.read(len(ARROW_FILE_MAGIC))
    source.seek(0)
    return pa.ipc.open_file(source) if head == ARROW_FILE_MAGIC else pa.ipc.open_stream(source)


def arrow_batches(source):
    """The record batches of a memory-mapped Arrow IPC file or stream, in order."""
    reader = _arrow_reader(source)
    if hasattr(reader, "num_record_batches"):
        return (reader.get_batch(i) for i in range(reader.num_record_batches))
    return iter(reader)


ARROW_END = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # an Arrow IPC stream's end-of-stream marker (continuation, 0 length)


def stream_closed(path: Path) -> bool:
    """Whether an Arrow stream file ends with its end-of-stream marker (a writer closed it): a stream cut between two
    record batches reads without an error, and without the batches after the cut."""
    with open(path, "rb") as f:
        if f.read(len(ARROW_FILE_MAGIC)) == ARROW_FILE_MAGIC:
            return True  # the file format: its footer is read first, and a cut one is an error
        f.seek(0, 2)
        size = f.tell()
        if size < len(ARROW_END):
            return False
        f.seek(size - len(ARROW_END))
        return f.read() == ARROW_END


def arrow_fields(path: Path) -> list[str]:
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        return _arrow_reader(source).schema.names


def partition(pieces: list[Piece], tasks: int) -> list[list[Piece]]:
    """Contiguous runs of pieces of about equal bytes, one per task (in order: part k follows part k-1)."""
    total = sum(p.size for p in pieces) or 1
    runs: list[list[Piece]] = [[] for _ in range(tasks)]
    done = 0
    for p in pieces:
        runs[min(tasks - 1, (done + p.size // 2) * tasks // total)].append(p)
        done += p.size
    return runs


# -- reading one piece -----------------------------------------------------------------------------------------

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
    """The fields a record is read from, by the data key that names each (data.format)."""
    kind = data_cfg.get("format", "text")
    if kind == "prompt_completion":
        return {"prompt_field": data_cfg.prompt_field, "completion_field": data_cfg.completion_field}
    if kind == "chat":
        return {"messages_field": data_cfg.messages_field}
    return {"text_field": data_cfg.text_field}


class Where:
    """Where a record is, for a message: its file and line (JSON Lines, from the line's offset: counted only when
    printed) or row (Parquet, Arrow)."""

    def __init__(self, path, line_start: Optional[int] = None, row: Optional[int] = None):
        self.path, self.line_start, self.row = path, line_start, row

    def __str__(self) -> str:
        if self.line_start is not None:
            return f"{self.path}: line {line_number(self.path, self.line_start)}"
        return f"{self.path}: row {self.row}"


def records(piece: Piece, fields: dict[str, str], val_fraction: float,
            optional: Optional[dict[str, str]] = None) -> Iterator[tuple[str, dict, Where]]:
    """(split, {key: the value of its field}, where it is) of each record of a JSON Lines or Parquet piece; fields
    maps the data keys that name fields (text_field, prompt_field, ...) to the names. The split comes from the
    record's name (file and line, or file and row). A record without one of the fields is refused, naming file and
    line; one without an `optional` field (data.tools_field) has None there."""
    optional = optional or {}
    if piece.kind == "jsonl":
        for line_start, record in _json_records(piece):
            missing = next((k for k, f in fields.items() if f not in record), None)
            if missing is not None:
                raise InputFault(f"{Where(piece.path, line_start)} {no_field(fields[missing], record)}: "
                                 f"data.{missing}= the field that holds it")
            yield (_split(f"{piece.name}@{line_start}", val_fraction),
                   {**{k: record.get(f) for k, f in optional.items()}, **{k: record[f] for k, f in fields.items()}},
                   Where(piece.path, line_start))
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


def _json_records(piece: Piece) -> Iterator[tuple[int, dict]]:
    for line_start, line in _lines(piece):
        if not line.strip():
            continue
        try:
            record = json_object(line)
        except ValueError as e:
            raise InputFault(f"{piece.path}: line {line_number(piece.path, line_start)} {e}") from None
        yield line_start, record


def line_number(path: str, offset: int) -> int:
    """The line that starts at byte `offset` (counted only when a message needs it)."""
    count, done = 1, 0
    with (open_decompressed(path) if packed(path) else open(path, "rb")) as f:
        while done < offset:
            block = f.read(min(1 << 24, offset - done))
            if not block:
                break
            count += block.count(b"\n")
            done += len(block)
    return count
