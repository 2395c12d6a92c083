"""The tokenize stage: cached like any stage (a sweep tokenizes once, an edited file again), memory-mapped shards
equal to the corpus in memory, a BPE trained on the corpus whose model `transformers` generates with; streamed in
pieces of every format by any number of tasks with the same result, a bad line named by the stage, what
data.max_bytes leaves out said in the plan, fingerprints at stat speed, mixtures by weight."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import sysconfig

from plugins.data import build_batcher, corpus as corpora, reading, shards, tokenize_cost
from plugins.data.batcher import Batcher, tokenized
from plugins.data.rules import check
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
    assert isinstance(on_disk.corpus.train[0], shards.TokenStream) and on_disk.corpus.train[0].dtype == np.uint16
    assert all(isinstance(a, np.memmap) for a in on_disk.corpus.train[0].arrays)
    assert np.array_equal(on_disk.corpus.train[0], in_memory.corpus.train[0])
    assert np.array_equal(on_disk.corpus.val[0], in_memory.corpus.val[0])
    index = json.loads((tokens / shards.INDEX).read_text())
    assert index["tokenizer"] == "bytes" and index["vocab_size"] == 258 and index["eos"] == 256


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
    from plugins.data.corpus import corpus_layout, task_documents

    cfg_args = ("data=text", f"data.paths=[{corpus}/records.jsonl]", "data.text_field=body")
    cfg = make_cfg(*cfg_args)
    docs = [d for d in task_documents(cfg, corpus_layout(cfg), 0, 1) if any(d[1])]  # (a piece may start no line)
    assert len(docs) == 40 and all(closes for _, _, closes, _ in docs)
    assert docs[3][1] == ((corpus / "doc03.txt").read_bytes(),)  # a document's texts: one, its text field's
    assert {split for split, *_ in docs} == {"train"}  # no record's name hashes into 5% here, so the held-out
    held_out = tokenized(make_cfg(*cfg_args, "data.packing=false")).val  # split borrows the last one, as a list would
    assert len(held_out) == 1 and bytes(held_out[0][:-1].astype(np.uint8)) == (corpus / "doc39.txt").read_bytes()


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

    from plugins.data.sources.files import _fingerprint_text

    moved = tmp_path / "elsewhere" / "corpus"
    shutil.copytree(corpus, moved)
    here, there = (make_cfg("data=text", f"data.paths=[{c}]", "data.text_field=body", "data.packing=false")
                   for c in (corpus, moved))
    assert _fingerprint_text(here.data) == _fingerprint_text(there.data)
    a, b = tokenized(here), tokenized(there)
    assert len(a.val) == len(b.val) and all(np.array_equal(x, y) for x, y in zip(a.val, b.val))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Path:
    """Every format, each bigger than the thresholds the test sets: a big text file, small text files, JSON Lines,
    a Parquet file of several row groups and a Hugging Face `save_to_disk` folder (an Arrow stream)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path_factory.mktemp("mixed")
    texts = [p.read_text(errors="replace") for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:60]]
    (folder / "a_big.txt").write_text("".join(texts[:20]))
    for i, t in enumerate(texts[20:26]):
        (folder / f"b_small{i}.md").write_text(t)
    with open(folder / "c_records.jsonl", "w") as f:
        for t in texts[26:46]:
            f.write(json.dumps({"text": t}) + "\n\n")
    pq.write_table(pa.table({"text": texts[46:60]}), folder / "d_rows.parquet", row_group_size=3)
    saved = folder / "e_saved_dataset"  # what datasets' save_to_disk writes: an Arrow stream of record batches
    saved.mkdir()
    with pa.OSFile(str(saved / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, pa.schema([("text", pa.string()), ("id", pa.int64())])) as stream:
            for i in range(0, 20, 4):
                stream.write_batch(pa.record_batch([texts[i:i + 4], list(range(i, i + 4))], names=["text", "id"]))
    (saved / "dataset_info.json").write_text("{}")
    return folder


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_n_tasks_write_what_one_task_writes_in_every_format(mixed, tmp_path, monkeypatch, tokenizer):
    """The pieces of a corpus (every 16 KiB here, 1 MiB in use) dealt to 1 or 3 tasks give the same shards and the
    same batches, packed and per document; each task encodes 8 KiB at a time, so every format streams."""
    monkeypatch.setattr(reading, "CHUNK_BYTES", 16 << 10)
    monkeypatch.setattr(corpora, "ENCODE_BYTES", 8 << 10)
    cfg = make_cfg("data=text", f"data.paths=[{mixed}]", "data.max_bytes=0", f"data.tokenizer={tokenizer}",
                   "data.vocab_size=300", "data.bpe_sample_bytes=100000", "model.vocab_size=320")
    lay = corpora.corpus_layout(cfg)
    assert len(lay.pieces) > 12 and {p.kind for p in lay.pieces} == {"text", "jsonl", "parquet", "arrow"}
    tok = corpora.build_tokenizer(cfg, [(cfg, lay)])
    corpus = {}
    for tasks in (1, 3):
        folder = tmp_path / f"tasks{tasks}"
        for task in range(tasks):
            corpora.write_part(cfg, lay, tok, folder, task, tasks)
        parts = [shards.part_name(t) for t in range(tasks)]
        index = shards.write_index(folder, parts, tok.vocab_size, tok.eos, tok.pad, tok.kind)
        corpus[tasks] = (shards.read(folder, packed=True), shards.read(folder, packed=False), index)
    (one, one_docs, index1), (three, three_docs, index3) = corpus[1], corpus[3]
    assert {k: index1[k] for k in ("train", "val")} == {k: index3[k] for k in ("train", "val")}
    assert np.array_equal(one.train[0], three.train[0]) and np.array_equal(one.val[0], three.val[0])
    assert len(one_docs.train) == len(three_docs.train) == index1["train"]["documents"]
    assert all(np.array_equal(a, b) for a, b in zip(one_docs.train, three_docs.train))
    for packed, (a, b) in ((True, (one, three)), (False, (one_docs, three_docs))):
        x, y = Batcher(a, 4, 32, seed=7), Batcher(b, 4, 32, seed=7)
        assert all(np.array_equal(x.train_batch(s).inputs, y.train_batch(s).inputs) for s in range(20))
    if tokenizer == "bytes":  # nothing lost or added: every byte of every document, each followed by <eos>
        files = sorted(mixed.iterdir())
        text_bytes = sum(f.stat().st_size for f in files if f.suffix in (".txt", ".md"))
        import pyarrow.parquet as pq

        records = [json.loads(line)["text"] for line in (mixed / "c_records.jsonl").read_text().splitlines() if line]
        records += pq.read_table(mixed / "d_rows.parquet").column("text").to_pylist()
        records += [p.read_text(errors="replace") for p in
                    sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:20]]  # the Arrow stream's
        expected = text_bytes + sum(len(r.encode()) for r in records) + 7 + len(records)
        assert index1["train"]["tokens"] + index1["val"]["tokens"] == expected
        assert index1["train"]["documents"] + index1["val"]["documents"] == 7 + len(records)


def test_a_bad_line_deep_in_a_big_jsonl_is_named_by_the_stage_and_nothing_is_published(tmp_path):
    """The check before launch reads each file's head (here the first MiB, which is fine); the stage reads every
    line and fails naming the file and the line, and publishes nothing."""
    big = tmp_path / "big.jsonl"
    line = json.dumps({"text": "x = 1\n" * 200}) + "\n"
    with open(big, "w") as f:
        for i in range(1200):
            f.write(line if i != 1100 else '{"text": "unterminated\n')
    assert len(line) * 1100 > 1 << 20  # past the head the check before launch reads
    report = run(tmp_path, "data=text", f"data.paths=[{big}]", "data.max_bytes=0")
    assert report.results["tokenize"].status == "failed"
    assert f"{big}: line 1101 is not JSON" in report.results["tokenize"].error
    assert not list((tmp_path / "runs" / "cache" / "tokenize").glob("*[!k]"))  # only the .work folder


def test_the_plan_says_what_tokenize_reads_and_what_max_bytes_leaves_out(corpus):
    cfg = make_cfg("data=text", f"data.paths=[{corpus}]", "data.text_field=body", "data.max_bytes=100000")
    size = sum(p.stat().st_size for p in corpus.iterdir())
    lines = tokenize_cost.plan_lines(cfg, check(cfg).facts, tasks=2, cores=2)
    assert lines[0].startswith("data: tokenize reads ") and "2 task(s)" in lines[0]
    assert lines[1].startswith(f"warning: data.max_bytes=100000 leaves out {(size - 100000) / 1e6:,.1f} MB")
    assert "data.max_bytes=0 reads all of it" in lines[1]
    key, tasks, rule, fix = tokenize_cost.memory_problem(cfg, 100, 8 << 30, "available RAM")  # all tasks on one host
    assert (key, tasks, fix) == ("data.tasks", 100, "data.tasks=17 or fewer") and "46.88 GB" in rule
    assert tokenize_cost.memory_problem(cfg, 2, 8 << 30, "available RAM") is None
    whole = make_cfg("data=text", f"data.paths=[{corpus}]", "data.text_field=body", "data.max_bytes=0")
    assert len(tokenize_cost.plan_lines(whole, check(whole).facts, tasks=1, cores=2)) == 1


def test_an_untouched_corpus_is_fingerprinted_by_its_stamps(corpus, tmp_path, monkeypatch):
    """The data fingerprint hashes a file once, then only when its stamp changes (the cache's rule)."""
    from plugins.data import data_fingerprint
    from storage import file_hashes

    files = tmp_path / "files"
    files.mkdir()
    for p in sorted(corpus.glob("doc0*.txt")):
        (files / p.name).write_text(p.read_text())
    monkeypatch.setattr(file_hashes, "RACY_NS", 0)
    hashed = []
    real = file_hashes.sha256_file
    monkeypatch.setattr(file_hashes, "sha256_file", lambda p, *a: hashed.append(Path(p).name) or real(p, *a))
    cfg = make_cfg("data=text", f"data.paths=[{files}]", f"cache_dir={tmp_path / 'cache'}")
    (tmp_path / "cache").mkdir()
    first = data_fingerprint(cfg)
    assert len(hashed) == 10
    hashed.clear()
    assert data_fingerprint(cfg) == first and hashed == []
    (files / "doc03.txt").write_text((files / "doc03.txt").read_text() + "#")
    assert data_fingerprint(cfg) != first and hashed == ["doc03.txt"]


def test_a_mixture_draws_each_source_by_its_weight():
    """Each row draws its source by weight from (seed, step): over 1,000 steps the shares are within 2% of the
    weights, the same on every call."""
    from plugins.data.registry import Corpus

    a = Corpus([np.arange(0, 5000) % 100], [np.arange(0, 500) % 100], 320, packed=True)
    b = Corpus([100 + np.arange(0, 5000) % 100], [100 + np.arange(0, 500) % 100], 320, packed=True)
    batcher = Batcher([a, b], 8, 16, seed=3, weights=[0.7, 0.3])
    rows = np.concatenate([batcher.train_batch(step).sources for step in range(1000)])
    assert abs((rows == 0).mean() - 0.7) < 0.02
    batch = batcher.train_batch(5)
    assert np.array_equal(batch.sources, batcher.train_batch(5).sources)
    assert all((row < 100).all() == (s == 0) for row, s in zip(batch.inputs.numpy(), batch.sources))


def test_changing_a_mixture_weight_retokenizes_nothing(tmp_path, corpus):
    """Two sources tokenized once (one stage, a folder per source, one tokenizer); a new weight trains again on the
    same shards."""
    mix = "data.mix=[{{paths: [{0}/doc0*.txt], weight: {1}}}, {{paths: [{0}/records.jsonl], text_field: body, " \
          "weight: 1.0}}]"
    first = run(tmp_path, "data=text", mix.format(corpus, 3.0), "data.max_bytes=0", name="first")
    assert first.exit_code == 0, first.results
    index = json.loads((cache_entry(tmp_path, first, "tokenize") / "tokens" / shards.INDEX).read_text())
    assert index["mix"] == ["source-00", "source-01"]
    again = run(tmp_path, "data=text", mix.format(corpus, 0.5), "data.max_bytes=0", name="again")
    assert again.results["tokenize"].status == "cached" and again.results["train"].status == "ran"
    assert again.results["train"].key != first.results["train"].key
