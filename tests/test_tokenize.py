"""The tokenize stage: cached like any stage (a sweep tokenizes once, an edited file again), memory-mapped shards
equal to the corpus in memory, a BPE trained on the corpus whose model `transformers` generates with."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import sysconfig

from plugins.data import build_batcher, shards
from plugins.data.batcher import tokenized
from plugins.data.tokenizer import _bytes_backend, encode
from tests.conftest import QUICK, cache_entry, make_cfg, run_cli, run_debug as run, run_folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """40 real text files (the standard library's first modules) and a JSON Lines file of the same texts."""
    folder = tmp_path_factory.mktemp("corpus")
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]
    for i, p in enumerate(stdlib):
        (folder / f"doc{i:02d}.txt").write_text(p.read_text(errors="replace"))
    with open(folder / "records.jsonl", "w") as f:
        for p in stdlib:
            f.write(json.dumps({"body": p.read_text(errors="replace"), "id": p.name}) + "\n")
    return folder


def test_shards_hold_the_corpus_in_memory_bit_for_bit(tmp_path):
    report = run(tmp_path)
    tokens = cache_entry(tmp_path, report, "tokenize") / "tokens"
    cfg = make_cfg()
    on_disk, in_memory = build_batcher(cfg, tokens), build_batcher(cfg)
    assert isinstance(on_disk.corpus.train[0], np.memmap) and on_disk.corpus.train[0].dtype == np.uint16
    assert np.array_equal(on_disk.corpus.train[0], in_memory.corpus.train[0])
    assert np.array_equal(on_disk.corpus.val[0], in_memory.corpus.val[0])
    index = json.loads((tokens / shards.INDEX).read_text())
    assert index["tokenizer"] == "bytes" and index["vocab_size"] == 258 and index["eos"] == 256


def test_unpacked_shards_keep_document_boundaries(tmp_path, corpus):
    args = ["data=text", f"data.paths=[{corpus}/doc0*.txt]", "data.packing=false"]
    report = run(tmp_path, *args)
    assert report.exit_code == 0, report.results
    cfg = make_cfg(*args)
    on_disk = shards.read(cache_entry(tmp_path, report, "tokenize") / "tokens", packed=False)
    in_memory = tokenized(cfg)
    assert len(on_disk.train) == len(in_memory.train) == 9 and len(on_disk.val) == 1
    assert all(np.array_equal(a, b) for a, b in zip(on_disk.train, in_memory.train))


def test_a_sweep_of_three_learning_rates_tokenizes_once(workdir):
    result = run_cli(["-m", "optimizer.lr=1e-3,3e-4,1e-4", *QUICK, "train.steps=2", "tracking=none"], workdir)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    plans = sorted((workdir / "runs" / "multirun").rglob("plan.json"))
    assert len(plans) == 3
    tokenize = [next(p for p in json.loads(f.read_text()) if p["stage"] == "tokenize") for f in plans]
    assert len({p["key"] for p in tokenize}) == 1
    assert len(list((workdir / "runs" / "cache" / "tokenize").glob("*[!k]"))) == 1  # one entry (no .work left)


def test_an_edited_corpus_file_tokenizes_again(tmp_path, corpus):
    files = tmp_path / "files"
    files.mkdir()
    for p in sorted(corpus.glob("doc0*.txt")):
        (files / p.name).write_text(p.read_text())
    args = ["data=text", f"data.paths=[{files}]"]
    first = run(tmp_path, *args, name="first")
    assert run(tmp_path, *args, name="again").results["tokenize"].status == "cached"
    (files / "doc03.txt").write_text((files / "doc03.txt").read_text().replace("def ", "def  ", 1))
    edited = run(tmp_path, *args, name="edited")
    assert edited.results["tokenize"].status == "ran" and edited.results["tokenize"].key != first.results[
        "tokenize"].key


def test_jsonl_records_are_documents_of_their_text_field(corpus):
    cfg = make_cfg("data=text", f"data.paths=[{corpus}/records.jsonl]", "data.text_field=body")
    from plugins.data.sources import _text_documents

    docs = _text_documents(cfg.data)
    assert len(docs) == 40 and docs[0][0].endswith("records.jsonl#0")
    assert docs[3][1] == (corpus / "doc03.txt").read_bytes()


def test_the_bytes_tokenizer_saved_for_transformers_encodes_as_bytes():
    text = "héllo wörld\n\tdef f(x): return x  # ✓"
    backend = _bytes_backend()
    assert backend.encode(text, add_special_tokens=False).ids == encode(text.encode()).tolist()
    assert backend.decode(backend.encode(text).ids) == text


def test_bpe_on_text_files_trains_and_its_hf_folder_generates(workdir, corpus):
    """The issue's command, as a new user types it; then transformers' pipeline on the aggregate's hf/ folder."""
    from transformers import pipeline

    args = ["data=text", f"data.paths=[{corpus}/*.txt]", "data.tokenizer=bpe", "data.vocab_size=2048",
            "model.vocab_size=2048", "train.steps=30", "train.batch_size=8", "train.seq_len=64", "tracking=none"]
    result = run_cli(args, workdir, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"tokenize\s+│ ran", result.stdout) and "(bpe, vocabulary 2,048)" in result.stdout
    run_dir = run_folder(result)
    hf_dir = run_dir / "stages/aggregate/output/hf"
    assert (hf_dir / "tokenizer.json").is_file()
    generate = pipeline("text-generation", model=str(hf_dir), tokenizer=str(hf_dir))
    text = generate("def ", max_new_tokens=16, do_sample=False)[0]["generated_text"]
    assert text.startswith("def ") and len(text) > len("def ")
    again = run_cli(args, workdir, timeout=300)
    assert re.search(r"tokenize\s+│ cached", again.stdout)


def test_a_moved_corpus_keeps_its_split_and_its_cache_key(tmp_path, corpus):
    """Files are split (and fingerprinted) by their names inside the folder given, not by where it lives."""
    import shutil

    from plugins.data.sources import _fingerprint_text

    moved = tmp_path / "elsewhere" / "corpus"
    shutil.copytree(corpus, moved)
    here, there = (make_cfg("data=text", f"data.paths=[{c}]", "data.text_field=body", "data.packing=false")
                   for c in (corpus, moved))
    assert _fingerprint_text(here.data) == _fingerprint_text(there.data)
    a, b = tokenized(here), tokenized(there)
    assert len(a.val) == len(b.val) and all(np.array_equal(x, y) for x, y in zip(a.val, b.val))
