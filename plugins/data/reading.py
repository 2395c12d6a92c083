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

import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from plugins.data.compressed import JSON_LINES, packed, packed_size, suffix_of

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
