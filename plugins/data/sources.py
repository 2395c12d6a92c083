"""Built-in data sources: the Python standard library's source (default), the user's files, random tokens.

`text` reads files and folders (globs too): text files are one document each; JSON Lines and Parquet files hold one
document per record, in the column `data.text_field`. Both are read in pieces (plugins/data/reading.py): the checks
before launch read each file's head, the fingerprint each file's stamp (storage/file_hashes.py).
"""
from __future__ import annotations

import functools

import glob
import hashlib
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np

from plugins.data.folders import FolderError, UnreadFiles, folder_files, kind
from plugins.data.megatron import is_indexed, prefix_of
from plugins.data.packing import packed_stream
from plugins.data.compressed import (PACKED, compression, decompress_errors, misnamed, open_decompressed, packed,
                                     suffix_of)
from plugins.data.unpack_advice import archive_advice, is_tar, unpack_advice
from plugins.data.piece_records import json_object, no_field, record_fields
from plugins.data.reading import ARROW, JSON_LINES, RECORDS, arrow_fields, layout, stream_closed
from plugins.data.bad_records import BadRecords
from plugins.data.first_records import read_first_records
from plugins.data.registry import Corpus, DataSource, register_source
from storage import file_hashes
from storage.fsio import digests, why_not_a_file

_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".jsonl", ".parquet", *ARROW)


def _walk(root: Path, suffixes: tuple[str, ...], skip: set[str] = frozenset()) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        found.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(suffixes))
    return found


def _field_missing(path: Path, field: str, by_record: bool = False) -> str:
    """Why a records file cannot give `field` of its records ('' when it can), from its head: the first
    SNIFF_BYTES of a JSON Lines file (the tokenize stage reads every line, naming file and line before publishing
    anything), a Parquet file's schema. by_record (data.format= a record format): a line that is not JSON, or lacks
    the field while others have it, is a bad record of its own, listed with the others (_read_first_records); the
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


def _check_amount(files: list[tuple[str, Path]], cfg) -> list[tuple]:
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


def _fingerprint_files(files: list[tuple[str, Path]], max_bytes: int) -> str:
    """The content of the files read under data.max_bytes (a changed file, same size and time included), each
    hashed again only when its stamp changed (storage/file_hashes.py), several at once (fsio.digests)."""
    h = hashlib.sha256(f"{max_bytes}".encode())
    read = files[:layout(files, max_bytes, 0.5).files]
    for (name, _), digest in zip(read, digests([path for _, path in read], file_hashes.sha256)):
        h.update(f"{name}\0{digest}\n".encode())
    return h.hexdigest()[:16]


# -- stdlib: the installed Python standard library's .py files (tests excluded) -------------------------

def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=1)
def _stdlib_files() -> list[tuple[str, Path]]:
    """(the installed standard library does not change under a running process: listed once, not per check)"""
    root = _stdlib_root()
    return [(p.relative_to(root).as_posix(), p) for p in _walk(root, (".py",), _SKIP_DIRS)]


def _check_stdlib(cfg) -> list[tuple]:
    return _check_amount(_stdlib_files(), cfg)


def _fingerprint_stdlib(cfg) -> str:
    return f"python{sys.version_info[0]}.{sys.version_info[1]}-" + _fingerprint_files(_stdlib_files(), cfg.max_bytes)


# -- text: the user's own files ---------------------------------------------------------------------------

def _doc_name(entry: Path, f: Path) -> str:
    """A file's name for the train / held-out split (a hash of it): its path inside the folder given, or its file
    name, so the split does not change when the corpus moves."""
    return f.relative_to(entry).as_posix() if entry.is_dir() else f.name


def _folder_files(folder: Path, d) -> list[Path]:
    """A folder's files: a datasets folder's data.split as datasets reads it, else its text and records files."""
    return folder_files(folder, d.get("split") or "train", _TEXT_SUFFIXES, frozenset({"__pycache__"}))


def _text_files(cfg) -> list[tuple[str, Path]]:
    files = []
    for entry in cfg.paths:
        p = Path(entry).expanduser()
        if _is_glob(entry):
            files.extend((m.name, m) for m in _glob(entry))
        elif p.is_dir():
            files.extend((_doc_name(p, f), f) for f in _folder_files(p, cfg))
        elif p.is_file():
            files.append((p.name, p))
        else:
            raise FileNotFoundError(f"data.paths entry {entry!r} does not exist")
    return unique_files(files)


class Files(list):
    """(name, path) of each file of a corpus, and how many more times data.paths named one of them."""
    named_twice = 0


def unique_files(files: list[tuple[str, Path]]) -> Files:
    """Each file once, where paths, globs or links name it twice (overlapping patterns, a folder and a file in it):
    the first name it was given, by its real path."""
    seen, kept = set(), Files()
    for name, path in files:
        real = os.path.realpath(path)
        if real not in seen:
            seen.add(real)
            kept.append((name, path))
    kept.named_twice = len(files) - len(kept)
    return kept


SNIFF_BYTES = 1 << 20  # how much of each file is checked for binary content and UTF-8 before launch


def _check_text(cfg) -> list[tuple]:
    """Every path exists and holds readable UTF-8 text; enough of it for a batch and the held-out split."""
    d = cfg.data
    problems: list[tuple] = []
    files: list[tuple[str, Path]] = []
    datasets_folder = False  # a datasets folder among data.paths (data.split is read)
    if not d.paths:
        return [("data.paths", "[]", "data=text needs files or folders to read", "data.paths='[/path/to/corpus]'")]
    for entry in d.paths:
        p = Path(entry).expanduser()
        if is_indexed(entry):  # a prefix (or its .bin or .idx) of a corpus tokenized for Megatron-LM: ids, not text
            problems.append(("data.paths", entry, "names a Megatron indexed dataset (its .idx opens with MMIDIDX): "
                             "token ids, which data=text would read as text", f"data=megatron "
                             f"'data.paths=[{prefix_of(entry)}]' data.tokenizer=hf:<the folder it was made with>"))
            continue
        if _is_glob(entry):
            matched = _glob(entry)
            files.extend((m.name, m) for m in matched)
            folders = sorted(p for p in glob.glob(os.path.expanduser(entry), recursive=True) if Path(p).is_dir())
            if folders:
                problems.append(("data.paths", entry, f"the pattern matches {len(folders)} folder(s) ("
                                 f"{', '.join(folders[:3])}), which a pattern does not search: they would be left "
                                 "out", "name the folders themselves in data.paths, or a pattern of files "
                                 "(folder/*.jsonl)"))
            elif not matched:
                problems.append(("data.paths", entry, "the pattern matches no file", "a pattern that matches files"))
            continue
        if p.is_dir():
            datasets_folder = datasets_folder or kind(p) != "plain"
            try:
                found = [(_doc_name(p, f), f) for f in _folder_files(p, d)]
            except UnreadFiles as e:
                problems.append(("data.paths", entry, str(e), "decompress them beside the others (gunzip -k, zstd "
                                 "-d, ...) and move the compressed ones out, or name the files to read"))
                continue
            except FolderError as e:
                problems.append(("data.split", d.split, str(e), "data.split= one of the splits it has"
                                 if "data.split=" in str(e) else "write the folder again (save_to_disk, or "
                                 "load_dataset for its cache)"))
                continue
            if not found:
                problems.append(("data.paths", entry, f"the folder holds no {', '.join(_TEXT_SUFFIXES)} files "
                                 "(folders are searched for those)", "a folder with text files, or the files"))
            files.extend(found)
        elif why := why_not_a_file(p):
            problems.append(("data.paths", entry, f"this path {why}", "an existing file or folder of text"
                             if not os.path.lexists(p) else "a regular text file, or a folder of them"))
        else:
            files.append((p.name, p))
    files = unique_files(files)
    problems += _unread_keys(d, files, datasets_folder or any((p.parent / "state.json").is_file() for _, p in files))
    bad, field_key = [], None
    fields, by_record = record_fields(d), d.format != "text"
    for name, path in files:
        why = why_not_a_file(path)
        if not why and suffix_of(path) in RECORDS:
            field_key, why = next(((k, w) for k, f in fields.items() if (w := _field_missing(path, f, by_record))),
                                  (None, ""))
        elif not why:
            why = _not_text(path) or (f"text, not records: data.format={d.format} reads JSON Lines or Parquet "
                                      "records" if d.format != "text" else "")
        if why:
            bad.append(f"{path}: {why}")
    if bad:
        key = f"data.{field_key}" if field_key and all("has no field" in b for b in bad) else "data.paths"
        problems.append((key, fields[field_key] if key != "data.paths" else list(d.paths), f"{len(bad)} file(s) "
                         "cannot be read as " + ("text: " if d.format == "text" else f"{d.format} records: ") +
                         "; ".join(bad[:3]) + ("; ..." if len(bad) > 3 else ""),
                         f"{key}= the column that holds it" if key != "data.paths" else
                         "remove them from data.paths, or repair them (UTF-8 text; in a .jsonl file, one JSON object "
                         "per line)" + (f"; data.format={d.format} reads .jsonl and .parquet files only"
                                        if d.format != "text" else "")))
    return problems or _first_records_problems(files, cfg) or _check_amount(files, cfg)


def _unread_keys(d, files: list[tuple[str, Path]], datasets_folder: bool) -> list[tuple]:
    """Keys set for what data.paths does not hold: ignored, they would let the run train on other data than meant."""
    problems = []
    if d.format == "text" and d.text_field != "text" and files and not any(suffix_of(p) in RECORDS for _, p in files):
        problems.append(("data.text_field", d.text_field, "names the field of JSON Lines, Parquet or Arrow records, "
                         f"and data.paths holds none ({len(files)} text file(s), each read whole as one document)",
                         "leave data.text_field unset, or data.paths= files of records"))
    if (d.get("split") or "train") != "train" and files and not datasets_folder:
        problems.append(("data.split", d.split, "picks a split of a datasets folder (DatasetDict.save_to_disk's, a "
                         "Hub snapshot), and data.paths names none: every file would be read whatever the split",
                         "leave data.split unset, or data.paths= the datasets folder"))
    return problems


def _first_records_problems(files: list[tuple[str, Path]], cfg) -> list[tuple]:
    """The first records of each records file (its first piece: SNIFF_BYTES of JSON Lines, a Parquet row group, a
    run of Arrow batches) read as the tokenize stage reads them: a mistake in their types, messages or template is
    refused now, naming the file and record, not after the stages before tokenize ran; every bad record among them
    in one refusal (plugins/data/bad_records.py)."""
    return read_first_records(files, cfg, SNIFF_BYTES)[0]


def bad_records_read(cfg) -> BadRecords:
    """The bad records among those the check before launch reads (for the plan, under data.bad_records=skip)."""
    return read_first_records(_text_files(cfg.data), cfg, SNIFF_BYTES)[1]


def _not_text(path: Path) -> str:
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


def _is_glob(entry: str) -> bool:
    return any(c in entry for c in "*?[")


def _glob(entry: str) -> list[Path]:
    return sorted(Path(p) for p in glob.glob(os.path.expanduser(entry), recursive=True) if Path(p).is_file())


def _fingerprint_text(cfg) -> str:
    return _fingerprint_files(_text_files(cfg), cfg.max_bytes)


# -- synthetic: uniform random tokens over the model's vocabulary --------------------------------------------

def _synthetic_tokens(cfg, model_vocab: int) -> Corpus:
    rng = np.random.default_rng(0)
    n = cfg.synthetic_tokens
    n_val = max(int(n * cfg.val_fraction), 1)
    stream = rng.integers(0, model_vocab, size=n, dtype=np.int64)
    return Corpus([stream[n_val:]], [stream[:n_val]], model_vocab, packed=True)


register_source("stdlib", DataSource(_fingerprint_stdlib, check=_check_stdlib, files=lambda cfg: _stdlib_files()))
register_source("text", DataSource(_fingerprint_text, check=_check_text, files=_text_files))
register_source("synthetic", DataSource(lambda cfg: "synthetic-v1", tokens=_synthetic_tokens))
