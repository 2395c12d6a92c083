"""data=text, the user's files: files and folders (globs too). Text files are one document each; JSON Lines, Parquet
and Arrow files hold one document per record, in the column `data.text_field` (or the fields of data.format's
records: the source carries every format). Both are read in pieces (plugins/data/reading.py): the checks before
launch read each file's head (plugins/data/file_heads.py), the fingerprint each file's stamp
(storage/file_hashes.py).
"""
from __future__ import annotations

import glob
import os
from pathlib import Path

from common.problem import Found
from plugins.data.compressed import suffix_of
from plugins.data.file_corpus import check_amount, fingerprint_files
from plugins.data.file_heads import SNIFF_BYTES, field_missing, not_text
from plugins.data.first_records import read_first_records
from plugins.data.folders import FolderError, UnreadFiles, folder_files, kind
from plugins.data.indexed_dataset import is_indexed, prefix_of
from plugins.data.formats.spec import format_of
from plugins.data.piece_records import record_fields
from plugins.data.reading import ARROW, RECORDS
from plugins.data.registry import DataSource, register_source
from storage.fsio import why_not_a_file

_TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".jsonl", ".parquet", *ARROW)


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
    fields, by_record = record_fields(d), format_of(d).records
    for name, path in files:
        why = why_not_a_file(path)
        if not why and suffix_of(path) in RECORDS:
            field_key, why = next(((k, w) for k, f in fields.items() if (w := field_missing(path, f, by_record))),
                                  (None, ""))
        elif not why:
            why = not_text(path) or (f"text, not records: data.format={d.format} reads JSON Lines or Parquet "
                                     "records" if by_record else "")
        if why:
            bad.append(f"{path}: {why}")
    if bad:
        key = f"data.{field_key}" if field_key and all("has no field" in b for b in bad) else "data.paths"
        problems.append((key, fields[field_key] if key != "data.paths" else list(d.paths), f"{len(bad)} file(s) "
                         "cannot be read as " + (f"{d.format} records: " if by_record else "text: ") +
                         "; ".join(bad[:3]) + ("; ..." if len(bad) > 3 else ""),
                         f"{key}= the column that holds it" if key != "data.paths" else
                         "remove them from data.paths, or repair them (UTF-8 text; in a .jsonl file, one JSON object "
                         "per line)" + (f"; data.format={d.format} reads .jsonl and .parquet files only"
                                        if by_record else "")))
    if problems:
        return problems
    first = _first_records_problems(files, cfg)
    return first if first else Found(check_amount(files, cfg), first.facts)


def _unread_keys(d, files: list[tuple[str, Path]], datasets_folder: bool) -> list[tuple]:
    """Keys set for what data.paths does not hold: ignored, they would let the run train on other data than meant."""
    problems = []
    if not format_of(d).records and d.text_field != "text" and files and \
            not any(suffix_of(p) in RECORDS for _, p in files):
        problems.append(("data.text_field", d.text_field, "names the field of JSON Lines, Parquet or Arrow records, "
                         f"and data.paths holds none ({len(files)} text file(s), each read whole as one document)",
                         "leave data.text_field unset, or data.paths= files of records"))
    if (d.get("split") or "train") != "train" and files and not datasets_folder:
        problems.append(("data.split", d.split, "picks a split of a datasets folder (DatasetDict.save_to_disk's, a "
                         "Hub snapshot), and data.paths names none: every file would be read whatever the split",
                         "leave data.split unset, or data.paths= the datasets folder"))
    return problems


def _first_records_problems(files: list[tuple[str, Path]], cfg) -> Found:
    """The first records of each records file (its first piece: SNIFF_BYTES of JSON Lines, a Parquet row group, a
    run of Arrow batches) read as the tokenize stage reads them: a mistake in their types, messages or template is
    refused now, naming the file and record, not after the stages before tokenize ran; every bad record among them
    in one refusal (plugins/data/bad_records.py). The bad records read are handed on with the refusals (Found.facts):
    under data.bad_records=skip the plan names them (plugins/data/rules.py)."""
    refusals, bad = read_first_records(files, cfg, SNIFF_BYTES)
    return Found(refusals, bad)


def _is_glob(entry: str) -> bool:
    return any(c in entry for c in "*?[")


def _glob(entry: str) -> list[Path]:
    return sorted(Path(p) for p in glob.glob(os.path.expanduser(entry), recursive=True) if Path(p).is_file())


def _fingerprint_text(cfg) -> str:
    return fingerprint_files(_text_files(cfg), cfg.max_bytes)


register_source("text", DataSource(_fingerprint_text, check=_check_text, files=_text_files, formats=None,
                                   fields=True))
