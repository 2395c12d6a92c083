"""What a folder in data.paths holds: a Hugging Face `datasets` folder read as `datasets` reads it, else its files.

- `Dataset.save_to_disk`: the Arrow files its state.json names (not the `cache-*.arrow` files `.map()` leaves
  beside them, nor its JSON metadata).
- `DatasetDict.save_to_disk`: the split data.split names (dataset_dict.json lists them), read as above.
- `load_dataset`'s cache (dataset_info.json beside `json-train.arrow`, `json-test-00000-of-00002.arrow`, ...): the
  Arrow files of data.split, by the names datasets gives them (the splits' shard counts in dataset_info.json).
- A Hub snapshot (a dataset card, README.md, beside its data files): the files of data.split as
  `load_dataset(folder)` finds them: the card's `configs: data_files` where it names them, else the split in the
  files' names (`train-00000-of-00001.parquet`, `data/test.jsonl`, ...; with no split in any name, every file is
  the train split).
- Any other folder: every file with a suffix of `suffixes`, in name order.

Compressed JSON Lines of those suffixes (`part-0001.jsonl.gz`, c4's `.json.gz`) are read (plugins/data/compressed.py);
other compressed files that would be read decompressed (`.txt.gz`) are refused, naming them: read without them, the
corpus would be a part of itself.
"""
from __future__ import annotations

import fnmatch
import glob
import json
import os
from pathlib import Path
from typing import Optional

from plugins.data.compressed import PACKED, reads
from plugins.data.reading import ARROW

# datasets.data_files' keywords of a split in a file's path (DEFAULT_PATTERNS_SPLIT_IN_FILENAME/_DIR_NAME)
SPLIT_KEYWORDS = {"train": ("train", "training"), "validation": ("validation", "valid", "dev", "val"),
                  "test": ("test", "testing", "eval", "evaluation")}
_SEP = "[-._ 0-9]"
DATA_SUFFIXES = (".parquet", ".jsonl", ".json", *ARROW)


class FolderError(ValueError):
    """A datasets folder that cannot give data.split (the message says why and what it has)."""


def kind(folder: Path) -> str:
    """dataset_dict | dataset | cache | hub | plain."""
    if (folder / "dataset_dict.json").is_file():
        return "dataset_dict"
    if (folder / "state.json").is_file():
        return "dataset"
    if (folder / "dataset_info.json").is_file() and _is_cache(folder):
        return "cache"
    if _is_dataset_card(folder / "README.md"):
        return "hub"
    return "plain"


def folder_files(folder: Path, split: str, suffixes: tuple[str, ...], skip: frozenset = frozenset()) -> list[Path]:
    """The files a folder gives for data.split: a datasets folder's, else its files of those suffixes in name order,
    folders named in `skip` left out and a datasets folder inside it read as one (never its other splits, caches or
    metadata)."""
    what = kind(folder)
    if what == "dataset_dict":
        splits = _json(folder / "dataset_dict.json").get("splits") or []
        if split not in splits:
            raise FolderError(f"{folder} is a DatasetDict saved by save_to_disk whose splits are "
                              f"{', '.join(map(json.dumps, splits)) or 'none'}; data.split={split} is none of them")
        return folder_files(folder / split, split, suffixes, skip)
    if what == "dataset":
        files = [folder / entry["filename"] for entry in _json(folder / "state.json").get("_data_files") or []
                 if isinstance(entry, dict) and isinstance(entry.get("filename"), str)]
        missing = [f.name for f in files if not f.is_file()]
        if missing or not files:
            raise FolderError(f"{folder} is a Dataset saved by save_to_disk whose state.json names "
                              + (f"files that are missing: {', '.join(missing[:3])}" if missing else "no data file"))
        return files
    if what == "cache":
        return _cache_files(folder, split)
    found = _walk(folder, split, suffixes, skip)
    if what == "plain":
        return found
    by_split = _card_splits(folder)
    if by_split is None:
        data = [f for f in found if reads(f.name, DATA_SUFFIXES)]
        by_split = {name: [f for f in data if _in_split(f.relative_to(folder).as_posix(), name)]
                    for name in SPLIT_KEYWORDS}
        if not any(by_split.values()):
            by_split = {"train": data}  # load_dataset: no split in any name, every file is train
    if not by_split.get(split):
        have = [name for name, files in by_split.items() if files]
        raise FolderError(f"{folder} is a dataset repository (README.md is a dataset card) whose data files give "
                          f"the splits {', '.join(have) or 'none'}; data.split={split} is none of them")
    return by_split[split]


class UnreadFiles(FolderError):
    """A folder that holds data in a form the tokenize stage does not read: read without it, the corpus would be a
    part of itself, and nothing would say so."""


def _compressed(filenames: list[str], suffixes: tuple[str, ...]) -> list[str]:
    """The files that would be read but for their compression (`notes.txt.gz`; `part-0001.jsonl.gz` is read)."""
    return [f for f in filenames if f.endswith(tuple(PACKED)) and f.rsplit(".", 1)[0].endswith(suffixes)
            and not reads(f, suffixes)]


def _walk(folder: Path, split: str, suffixes: tuple[str, ...], skip: frozenset) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        here = Path(dirpath)
        if here != folder and kind(here) != "plain":
            found += folder_files(here, split, suffixes, skip)
            dirnames[:] = []
            continue
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        if packed := _compressed(sorted(filenames), suffixes):
            read = sum(reads(f, suffixes) for f in filenames)
            raise UnreadFiles(f"{here} holds {len(packed)} compressed file(s) ({', '.join(packed[:3])}"
                              f"{', ...' if len(packed) > 3 else ''}) that the tokenize stage does not read "
                              "compressed (it reads compressed JSON Lines, x.jsonl.gz, alone): the "
                              f"corpus would be its other {read} file(s) alone")
        found += [here / f for f in sorted(filenames) if reads(f, suffixes)]
    return found


def _cache_info(folder: Path) -> Optional[tuple[str, dict]]:
    """(the dataset's name, its splits) as load_dataset's cache's dataset_info.json gives them; None where it names
    neither."""
    try:
        info = json.loads((folder / "dataset_info.json").read_text())
    except (OSError, ValueError):
        return None
    name = info.get("dataset_name") or info.get("builder_name") if isinstance(info, dict) else None
    splits = info.get("splits") if isinstance(info, dict) else None
    return (name, splits) if isinstance(name, str) and isinstance(splits, dict) else None


def _is_cache(folder: Path) -> bool:
    """load_dataset's cache: dataset_info.json names splits and a dataset, and a split's file is there by that name."""
    info = _cache_info(folder)
    return info is not None and any(
        next(folder.glob(f"{glob.escape(info[0])}-{glob.escape(str(split))}*.arrow"), None) for split in info[1])


def _cache_files(folder: Path, split: str) -> list[Path]:
    """A `load_dataset` cache's files of a split (kind: cache): `<name>-<split>.arrow`, or
    `<name>-<split>-00000-of-00003.arrow` ... where it was written in shards
    (datasets.naming.filenames_for_dataset_split)."""
    name, splits = _cache_info(folder)
    if split not in splits:
        raise FolderError(f"{folder} is a load_dataset cache whose splits are "
                          f"{', '.join(map(json.dumps, splits)) or 'none'}; data.split={split} is none of them")
    shards = len((splits[split] or {}).get("shard_lengths") or []) if isinstance(splits[split], dict) else 0
    stem = f"{name}-{split}"
    files = [folder / f"{stem}-{k:05d}-of-{shards:05d}.arrow" for k in range(shards)] if shards > 1 else \
        [folder / f"{stem}.arrow"]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FolderError(f"{folder} is a load_dataset cache whose dataset_info.json names the split {split}, and "
                          f"its files are missing: {', '.join(missing[:3])}")
    return files


def _card_splits(folder: Path) -> Optional[dict[str, list[Path]]]:
    """The files of each split as the dataset card's `configs:` name them (load_dataset reads them before any file
    name), None where it names none. Its default config, or its only one; several without a default are refused, as
    load_dataset(folder) refuses them."""
    import yaml

    head = (folder / "README.md").read_text(errors="replace")
    try:
        meta = yaml.safe_load(head[3:].split("\n---", 1)[0]) or {}
    except yaml.YAMLError as e:
        raise FolderError(f"{folder / 'README.md'}: its YAML metadata cannot be read ({e})") from None
    configs = meta.get("configs") if isinstance(meta, dict) else None
    if not isinstance(configs, list) or not configs:
        return None
    default = [c for c in configs if isinstance(c, dict) and (c.get("default") or c.get("config_name") == "default")]
    if not default and len(configs) > 1:
        names = [str(c.get("config_name")) for c in configs if isinstance(c, dict)]
        raise FolderError(f"{folder} is a dataset repository whose card names several configs ({', '.join(names)}) "
                          "and no default; name the config's data files in data.paths")
    files = (default or configs)[0].get("data_files") if isinstance((default or configs)[0], dict) else None
    if isinstance(files, (str, list)) and not (isinstance(files, list) and files and isinstance(files[0], dict)):
        files = {"train": files}
    elif isinstance(files, list):
        files = {entry.get("split", "train"): entry.get("path", []) for entry in files if isinstance(entry, dict)}
    if not isinstance(files, dict):
        return None
    by_split = {}
    for name, patterns in files.items():
        patterns = [patterns] if isinstance(patterns, str) else list(patterns or [])
        found = sorted({p for pattern in patterns for p in folder.glob(pattern) if p.is_file()})
        other = [p.name for p in found if not reads(p.name, DATA_SUFFIXES)]
        if other:
            raise FolderError(f"{folder}'s card gives the split {name} files of a kind the tokenize stage does not "
                              f"read ({', '.join(other[:3])}; it reads {', '.join(DATA_SUFFIXES)})")
        by_split[str(name)] = found
    return by_split


def _in_split(relative: str, split: str) -> bool:
    for keyword in SPLIT_KEYWORDS[split]:
        patterns = (f"{keyword}{_SEP}*", f"*{_SEP}{keyword}{_SEP}*", f"{keyword}/*", f"*/{keyword}/*")
        name = relative.rsplit("/", 1)[-1]
        if any(fnmatch.fnmatchcase(name, p) for p in patterns[:2]) or \
                any(fnmatch.fnmatchcase(relative, p) for p in patterns[2:]):
            return True
    return False


CARD_KEYS = (b"dataset_info:", b"configs:", b"task_categories:", b"size_categories:", b"pretty_name:", b"license:")


def _is_dataset_card(path: Path) -> bool:
    """A Hub dataset's README.md: YAML metadata first ('---') with a dataset card's keys (a site's Markdown page
    has front matter too, with other keys)."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return False
    if not head.startswith(b"---"):
        return False
    meta = head[3:].split(b"\n---", 1)[0]
    return any(line.lstrip().startswith(key) for line in meta.splitlines() for key in CARD_KEYS)


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise FolderError(f"{path} cannot be read as JSON ({e})") from None
    return value if isinstance(value, dict) else {}
