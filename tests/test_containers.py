"""The containers the tokenize stage reads records from, as `datasets` reads them: Parquet (sized by its rows),
`save_to_disk` folders, Hub snapshots and their cards, `load_dataset`'s cache, folders holding them, and compressed
JSON Lines."""
from __future__ import annotations

import json
import shutil

import pytest

from plugins.data.corpus import tokenized
from plugins.data.rules import check
from tests.conftest import make_cfg
from tests.test_records import BASE, documents


def _texts(corpus) -> list[str]:
    """The records' texts (data.tokenizer=bytes, one record a document: its bytes, then <eos>)."""
    return sorted(bytes(ids[:-1]).decode() for ids, _ in documents(corpus))


@pytest.fixture(scope="module")
def saved_datasets(tmp_path_factory):
    import datasets

    datasets.disable_progress_bars()
    root = tmp_path_factory.mktemp("datasets")
    rows = {split: [f"{split} record {i}: " + "words " * (5 + i % 7) for i in range(n)]
            for split, n in (("train", 40), ("test", 12))}
    whole = datasets.DatasetDict({s: datasets.Dataset.from_dict({"text": r}) for s, r in rows.items()})
    whole.save_to_disk(str(root / "dict"))
    one = datasets.Dataset.from_dict({"text": rows["train"]})
    one.save_to_disk(str(root / "mapped"))
    datasets.load_from_disk(str(root / "mapped")).map(lambda r: {"text": r["text"].upper()})  # leaves cache-*.arrow
    hub = root / "hub"
    (hub / "data").mkdir(parents=True)
    (hub / "README.md").write_text("---\nlicense: mit\n---\n# A dataset\n")
    for split, r in rows.items():
        datasets.Dataset.from_dict({"text": r}).to_parquet(str(hub / "data" / f"{split}-00000-of-00001.parquet"))
    raw = tmp_path_factory.mktemp("raw", numbered=False)  # load_dataset's cache of JSON Lines files beside root
    parts = {"train0": rows["train"][0::3], "train1": rows["train"][1::3], "train2": rows["train"][2::3],
             "test0": rows["test"]}  # the train split in three files: datasets starts a shard between two
    for name, r in parts.items():
        (raw / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in r))
    builder = cache_builder(root)
    builder.download_and_prepare(max_shard_size=600)  # json-test.arrow, json-train-0000N-of-0000M.arrow
    shutil.copytree(builder.cache_dir, root / "cache")
    return root


def cache_builder(root):
    import datasets

    raw = root.parent / "raw"
    return datasets.load_dataset_builder("json", data_files={s: sorted(map(str, raw.glob(f"{s}*.jsonl")))
                                                             for s in ("train", "test")},
                                         cache_dir=str(raw / "hf-cache"))


@pytest.mark.parametrize("folder,split", [("dict", "train"), ("dict", "test"), ("mapped", "train"), ("hub", "train"),
                                          ("hub", "test"), ("cache", "train"), ("cache", "test")])
def test_a_datasets_folder_gives_the_rows_datasets_gives(tmp_path, saved_datasets, folder, split):
    import datasets

    path = saved_datasets / folder
    assert folder != "mapped" or any(p.name.startswith("cache-") for p in path.iterdir())
    assert folder != "cache" or len(list(path.glob("json-train-0000*-of-*.arrow"))) > 1
    theirs = (datasets.load_dataset(str(path), split=split, cache_dir=str(tmp_path / "hf-cache")) if folder == "hub"
              else cache_builder(saved_datasets).as_dataset(split=split) if folder == "cache"
              else datasets.load_from_disk(str(path)))
    theirs = theirs[split] if isinstance(theirs, datasets.DatasetDict) else theirs
    cfg = make_cfg(*BASE, f"data.paths=[{path}]", f"data.split={split}", runs_dir=tmp_path)
    assert check(cfg) == []
    assert _texts(tokenized(cfg)) == sorted(theirs["text"])


@pytest.mark.parametrize("folder", ["dict", "cache"])
def test_a_split_a_datasets_folder_lacks_is_refused_naming_its_splits(saved_datasets, folder):
    problems = check(make_cfg(*BASE, f"data.paths=[{saved_datasets / folder}]", "data.split=validation"))
    assert [p.key for p in problems] == ["data.split"]
    assert 'splits are "train", "test"; data.split=validation is none of them' in problems[0].rule


# -- tokens as at inference: <bos> where the tokenizer adds one, one <eos>, TRL's joint encoding ----------------


def test_datasets_folders_inside_a_folder_are_read_as_datasets_folders(tmp_path, saved_datasets):
    """A plain folder holding a DatasetDict, a Dataset with a .map() cache, a Hub snapshot and load_dataset's cache:
    each gives its train
    split's rows once (no test split, no cache, no metadata); a .json file of JSON Lines named in data.paths is
    records (folders are not searched for .json files: they hold configs and metadata as often as data)."""
    import shutil

    root = tmp_path / "corpus"
    shutil.copytree(saved_datasets, root)
    (root / "extra.json").write_text("".join(json.dumps({"text": f"extra {i}"}) + "\n" for i in range(3)))
    cfg = make_cfg(*BASE, f"data.paths=[{root},{root}/extra.json]", runs_dir=tmp_path)
    assert check(cfg) == []
    train = [f"train record {i}: " + "words " * (5 + i % 7) for i in range(40)]
    assert _texts(tokenized(cfg)) == sorted(train * 4 + [f"extra {i}" for i in range(3)])  # dict, mapped, hub, cache


@pytest.mark.parametrize("split", ["train", "test"])
def test_a_dataset_cards_configs_name_the_splits_files_as_load_dataset_reads_them(tmp_path, split):
    """The card's `configs: data_files` come before file names: raw/train-junk.parquet, which the names would make
    the train split, is in no split."""
    import datasets

    datasets.disable_progress_bars()
    hub = tmp_path / "hub"
    (hub / "raw").mkdir(parents=True)
    for name, n in (("alpha", 20), ("beta", 10), ("train-junk", 10)):
        datasets.Dataset.from_dict({"text": [f"{name} {i} " * 3 for i in range(n)]}).to_parquet(
            str(hub / "raw" / f"{name}.parquet"))
    (hub / "README.md").write_text("---\nlicense: mit\nconfigs:\n- config_name: default\n  data_files:\n"
                                   "  - split: train\n    path: raw/alpha.parquet\n  - split: test\n"
                                   "    path: raw/beta.parquet\n---\n# A dataset\n")
    cfg = make_cfg(*BASE, f"data.paths=[{hub}]", f"data.split={split}", "train.eval_batches=1",  # 300 bytes of text
                   runs_dir=tmp_path)
    assert check(cfg) == []
    theirs = datasets.load_dataset(str(hub), split=split, cache_dir=str(tmp_path / "hf-cache"))  # not ~/.cache's
    assert _texts(tokenized(cfg)) == sorted(theirs["text"])


def test_compressed_json_lines_are_read_as_they_decompress_as_datasets_reads_them(tmp_path):
    """A corpus as public ones ship (c4's .json.gz, the Pile's .jsonl.zst): gzip, zstd (two frames), xz and bz2 in a
    folder beside plain JSON Lines give the records datasets gives; data.max_bytes cuts inside a compressed file at
    a line, as inside the same file decompressed; a file cut short fails the stage naming it."""
    import bz2
    import gzip
    import lzma

    import datasets
    import zstandard

    datasets.disable_progress_bars()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rows = [json.dumps({"text": f"record {i}: " + "word " * (i % 40)}).encode() + b"\n" for i in range(400)]
    parts = [b"".join(rows[k::5]) for k in range(5)]
    zstd = zstandard.ZstdCompressor()
    (corpus / "a.jsonl").write_bytes(parts[0])
    (corpus / "b.jsonl.gz").write_bytes(gzip.compress(parts[1]))
    (corpus / "c.jsonl.zst").write_bytes(zstd.compress(parts[2][:3000]) + zstd.compress(parts[2][3000:]))
    (corpus / "d.jsonl.xz").write_bytes(lzma.compress(parts[3]))
    (corpus / "e.jsonl.bz2").write_bytes(bz2.compress(parts[4]))
    cfg = make_cfg(*BASE, f"data.paths=[{corpus}]", runs_dir=tmp_path)
    assert check(cfg) == []
    theirs = datasets.load_dataset("json", data_files=sorted(map(str, corpus.iterdir())), split="train",
                                   cache_dir=str(tmp_path / "hf-cache"))
    assert _texts(tokenized(cfg)) == sorted(theirs["text"]) and len(theirs) == 400

    (tmp_path / "plain.jsonl").write_bytes(parts[1])
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "plain.jsonl.gz").write_bytes(gzip.compress(parts[1]))
    cut = [make_cfg(*BASE, f"data.paths=[{path}]", "data.max_bytes=2000", runs_dir=tmp_path)
           for path in (tmp_path / "plain.jsonl", tmp_path / "one" / "plain.jsonl.gz")]
    assert _texts(tokenized(cut[0])) == _texts(tokenized(cut[1])) and 10 < len(_texts(tokenized(cut[1]))) < 80

    (corpus / "b.jsonl.gz").write_bytes(gzip.compress(parts[1])[:-200])
    with pytest.raises(ValueError, match=r"b\.jsonl\.gz: cannot be decompressed \(EOFError"):
        tokenized(make_cfg(*BASE, f"data.paths=[{corpus}]", runs_dir=tmp_path / "again"))
    (corpus / "b.jsonl.gz").write_bytes(parts[1])  # not compressed at all: misnamed, not damaged
    with pytest.raises(ValueError, match=r"b\.jsonl\.gz: is not gzip-compressed, .*fix: rename it: mv .*b\.jsonl "):
        tokenized(make_cfg(*BASE, f"data.paths=[{corpus}]", runs_dir=tmp_path / "third"))
