"""data=megatron, checked by megatron-core itself: corpora its IndexedDatasetBuilder writes (uint16 and int32, a
document of several sequences, two prefixes) are read by the project document for document as its IndexedDataset
reads them, train beside the held-out split; broken ones are refused before launch naming the file."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from orchestrator.config.errors import ConfigError
from orchestrator.config.validate import validate
from plugins.data import shards
from plugins.data.corpus import TOKENS_DIR, tokenize_into
from tests.conftest import make_cfg, run_debug

VOCAB = 320
EOS = 257


def _build(prefix: Path, dtype, documents: list[list[list[int]]]) -> None:
    """A corpus as megatron-core's builder writes one: each document a list of sequences (sentences)."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for sequences in documents:
        builder.add_document(torch.tensor([t for s in sequences for t in s], dtype=torch.int64),
                             [len(s) for s in sequences])
    builder.finalize(f"{prefix}.idx")


def _documents(seed: int, n: int) -> list[list[list[int]]]:
    rng = np.random.default_rng(seed)
    docs = [[[*rng.integers(0, 256, int(rng.integers(5, 60))).tolist(), EOS]] for _ in range(n)]
    docs[3] = [[1, 2, 3], [4, 5, EOS]]  # split into sentences: one document, two sequences
    return docs


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict:
    """Two prefixes made by megatron-core (uint16 and int32), and the tokenizer folder they use."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tmp = tmp_path_factory.mktemp("megatron")
    _build(tmp / "web_text_document", np.uint16, _documents(0, 60))
    _build(tmp / "code_text_document", np.int32, _documents(1, 40))
    vocab = {f"<{i}>": i for i in range(VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=f"<{EOS}>").save_pretrained(tmp / "tok")
    return {"tmp": tmp, "prefixes": [tmp / "web_text_document", tmp / "code_text_document"]}


def _args(corpora, *more: str) -> list[str]:
    paths = ",".join(str(p) for p in corpora["prefixes"])
    return ["data=megatron", f"data.paths=[{paths}]", f"data.tokenizer=hf:{corpora['tmp'] / 'tok'}",
            f"model.vocab_size={VOCAB}", "data.val_fraction=0.1", *more]


def test_documents_read_where_they_are_equal_megatron_cores_own_reading(corpora, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    cfg = make_cfg(*_args(corpora))
    validate(cfg)
    index = tokenize_into(cfg, tmp_path)
    theirs = []
    for prefix in corpora["prefixes"]:
        ds = IndexedDataset(str(prefix))
        docs = [np.concatenate([ds[s] for s in range(a, b)]).tolist()
                for a, b in zip(ds.document_indices[:-1], ds.document_indices[1:])]
        cut = len(docs) - max(round(len(docs) * 0.1), 1)  # the last tenth held out, as Megatron splits
        theirs.append((docs[:cut], docs[cut:]))
    corpus = shards.read(tmp_path / TOKENS_DIR, packed=False)
    assert [d.tolist() for d in corpus.train] == theirs[0][0] + theirs[1][0]
    assert [d.tolist() for d in corpus.val] == theirs[0][1] + theirs[1][1]
    packed = shards.read(tmp_path / TOKENS_DIR, packed=True)
    assert packed.train[0][:].tolist() == [t for d in theirs[0][0] + theirs[1][0] for t in d]
    assert index["train"]["documents"] == 54 + 36 and index["val"]["documents"] == 6 + 4
    assert not list((tmp_path / TOKENS_DIR).glob("*/*.bin"))  # nothing copied: the index points at their files
    web, code = corpora["prefixes"]  # a blend, Megatron's [0.7, web, 0.3, code]: each source its own folder
    blend = [f"data.mix=[{{paths:[{web}],weight:0.7}},{{paths:[{code}],weight:0.3}}]", "data.paths=[]"]
    report = run_debug(tmp_path / "run", *_args(corpora, "train.steps=2", "train.batch_size=4", "train.seq_len=32"),
                       *blend)
    assert report.results["train"].status == "ran"
    mixed = shards.read_all(tmp_path / "run" / "runs" / "cache" / "tokenize" / report.results["tokenize"].key
                            / TOKENS_DIR, packed=False)
    assert [[d.tolist() for d in c.train] for c in mixed] == [theirs[0][0], theirs[1][0]]
    with pytest.raises(ConfigError) as e:  # the blend as Megatron's --data-path spells it
        validate(make_cfg(*_args(corpora)[:1], f"data.paths=[0.7,{web},0.3,{code}]", *_args(corpora)[2:]))
    assert "data.mix=[{paths:[" in e.value.problems[0].fix and e.value.problems[0].key == "data.paths"


def test_the_tokenize_stages_parts_are_megatron_datasets_megatron_core_reads(tmp_path):
    """Each part's split (part-00000/train.bin + .idx) is a Megatron indexed dataset: megatron-core's IndexedDataset
    reads the documents the project reads, in two parts (the corpus cut between two tasks) and after a small
    corpus's last document moved to the held-out split."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from plugins.data.indexed_dataset import write_index

    docs = [np.arange(n, dtype=np.int32) + n for n in (3, 1, 7, 2)]  # write_index alone, as a writer of corpora
    (tmp_path / "ours.bin").write_bytes(np.concatenate(docs).tobytes())
    write_index(str(tmp_path / "ours"), np.int32, [len(d) for d in docs])
    ds = IndexedDataset(str(tmp_path / "ours"))
    assert [ds[i].tolist() for i in range(len(ds))] == [d.tolist() for d in docs]
    records = tmp_path / "records.jsonl"
    records.write_text("".join(f'{{"text": "record {i} says {"word " * (i % 7)}"}}\n' for i in range(300)))
    for tasks in (1, 2):
        from plugins.data.corpus import corpus_layouts, finish_all, write_part
        from plugins.data import tokenizer as tokenizers

        cfg = make_cfg("data=text", f"data.paths=[{records}]", "data.val_fraction=0.2")
        out, tok = tmp_path / f"tasks{tasks}", tokenizers.make(cfg.data)
        corpora = corpus_layouts(cfg)
        for task in range(tasks):
            write_part(*corpora[0], tok, out, task, tasks)
        finish_all(out, tasks, tok, cfg, corpora)
        ours = shards.read(out, packed=False)
        for split, documents in (("train", ours.train), ("val", ours.val)):
            theirs = []
            for part in sorted(out.glob("part-*")):
                if not (part / f"{split}.bin").stat().st_size:  # megatron-core cannot memory-map an empty .bin
                    continue
                ds = IndexedDataset(str(part / split))
                theirs += [ds[i].tolist() for i in range(len(ds))]
            assert theirs == [d.tolist() for d in documents] and len(theirs) > 10, (tasks, split)
    small = tmp_path / "small.jsonl"  # too few records for a held-out one: the last one moves there
    small.write_text("".join(f'{{"text": "record {i}"}}\n' for i in range(3)))
    index = tokenize_into(make_cfg("data=text", f"data.paths=[{small}]", "data.val_fraction=0.01"), tmp_path / "small")
    ours = shards.read(tmp_path / "small" / TOKENS_DIR, packed=False)
    for split, documents in (("train", ours.train), ("val", ours.val)):
        ds = IndexedDataset(str(tmp_path / "small" / TOKENS_DIR / "part-00000" / split))
        assert [ds[i].tolist() for i in range(len(ds))] == [d.tolist() for d in documents]
    assert index["val"]["documents"] == 1 and index["train"]["documents"] == 2


def _broken(corpora, tmp_path: Path, how: str) -> Path:
    prefix = tmp_path / "broken_text_document"
    for suffix in (".bin", ".idx"):
        shutil.copy(f"{corpora['prefixes'][0]}{suffix}", f"{prefix}{suffix}")
    idx, bin_ = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    raw = bytearray(idx.read_bytes())
    if how == "magic":
        raw[:7] = b"NOTMMID"
    elif how == "dtype":
        raw[17] = 6  # float64: not token ids
    elif how == "code":
        raw[17] = 42
    elif how == "index cut short":
        raw = raw[:len(raw) - 100]
    elif how == "bin cut short":
        bin_.write_bytes(bin_.read_bytes()[:1000])
    idx.write_bytes(bytes(raw))
    return prefix


@pytest.mark.parametrize("how,words", [
    ("magic", "does not start with Megatron's magic"), ("dtype", "dtype code 6, which is not a token type"),
    ("code", "dtype code 42"), ("index cut short", "it is cut short"), ("bin cut short", "past the end of"),
])
def test_a_broken_corpus_is_refused_before_launch_naming_its_file(corpora, tmp_path, how, words):
    prefix = _broken(corpora, tmp_path, how)
    with pytest.raises(ConfigError) as e:
        validate(make_cfg("data=megatron", f"data.paths=[{prefix}]", f"data.tokenizer=hf:{corpora['tmp'] / 'tok'}",
                          f"model.vocab_size={VOCAB}"))
    (problem,) = e.value.problems
    assert problem.key == "data.paths" and words in problem.rule and str(prefix) in problem.rule, problem.rule


def test_a_corpus_needs_the_tokenizer_it_was_made_with(corpora, tmp_path):
    with pytest.raises(ConfigError) as e:
        validate(make_cfg("data=megatron", f"data.paths=[{corpora['prefixes'][0]}]"))
    assert [p.key for p in e.value.problems] == ["data.tokenizer"]
    small = tmp_path / "small"  # a tokenizer of 200 tokens: ids past it are another tokenizer's
    import transformers
    from tokenizers import Tokenizer, models

    backend = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(200)}, unk_token="<0>"))
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<1>").save_pretrained(small)
    from common.problem import InputFault
    from plugins.data import get_source

    describe = get_source("megatron").describe
    assert not any("<eos>" in line for line in describe(make_cfg(*_args(corpora))))  # theirs end in <257>
    other = make_cfg("data=megatron", f"data.paths=[{corpora['prefixes'][0]}]", f"data.tokenizer=hf:{small}")
    assert "do not end in <eos> (id 1)" in describe(other)[1]  # said in the plan: made without --append-eod

    with pytest.raises(InputFault, match="holds token id 257, and data.tokenizer=hf:.* has 200 tokens"):
        tokenize_into(make_cfg("data=megatron", f"data.paths=[{corpora['prefixes'][0]}]", f"data.tokenizer=hf:{small}",
                               f"model.vocab_size={VOCAB}"), tmp_path / "out")


def test_a_fuzzed_index_is_read_whole_or_refused_naming_its_file(corpora, tmp_path):
    """Bytes of the .idx flipped or cut off at random (200 cases): read_index refuses naming the file, or what it
    reads is whole (documents in order, inside the .bin); never another exception, never a slice past the .bin."""
    from plugins.data.indexed_dataset import MegatronError, read_index, tokens_of

    source = Path(f"{corpora['prefixes'][0]}.idx").read_bytes()
    shutil.copy(f"{corpora['prefixes'][0]}.bin", tmp_path / "fuzzed.bin")
    rng, refused = np.random.default_rng(7), 0
    for case in range(200):
        raw = bytearray(source)
        if case % 3 == 0:
            raw = raw[:int(rng.integers(0, len(raw)))]
        else:
            for at in rng.integers(0, min(len(raw), 60 if case % 3 == 1 else len(raw)), int(rng.integers(1, 4))):
                raw[at] = int(rng.integers(0, 256))
        (tmp_path / "fuzzed.idx").write_bytes(bytes(raw))
        try:
            ix = read_index(str(tmp_path / "fuzzed"))
        except MegatronError as e:
            assert "fuzzed" in str(e), e
            refused += 1
            continue
        ends = ix.document_ends()
        assert np.all(np.diff(ends) >= 0) and (not len(ends) or ends[-1] <= len(tokens_of(ix)))
    assert refused >= 100  # most damage is refused; the rest read a whole index


def test_empty_documents_are_skipped_and_counted_in_the_plan_and_ids_are_read_once(corpora, tmp_path, monkeypatch):
    """preprocess_data.py writes an empty text as a document of no sequence: rows of documents (data.packing=false)
    read megatron-core's documents that hold tokens, the plan line counts the empty ones, and the index's document
    counts are of those read. The ids are read once before launch (smallest and largest), then remembered by the
    file's stamp: a second plan reads no token."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from plugins.data import get_source
    from plugins.data.sources import megatron_checks
    from storage import file_hashes

    docs = _documents(2, 30)
    for i in range(0, 30, 3):
        docs[i] = []  # a third of them empty, the held-out tail's first one too
    _build(tmp_path / "gaps_text_document", np.uint16, docs)
    args = ["data=megatron", f"data.paths=[{tmp_path / 'gaps_text_document'}]",
            f"data.tokenizer=hf:{corpora['tmp'] / 'tok'}", f"model.vocab_size={VOCAB}", "data.val_fraction=0.1",
            "data.packing=false", "train.seq_len=32"]
    cfg = make_cfg(*args, runs_dir=tmp_path / "runs")
    (tmp_path / "runs" / "cache" / ".verified").mkdir(parents=True)
    monkeypatch.setattr(file_hashes, "RACY_NS", 0)
    read = []
    real = megatron_checks.id_range
    monkeypatch.setattr(megatron_checks, "id_range", lambda ix: read.append(ix.prefix.name) or real(ix))
    validate(cfg)
    validate(cfg)
    assert read == ["gaps_text_document"]  # the second plan found them remembered
    assert "data: 10 of the 30 documents are empty (no token" in "\n".join(get_source("megatron").describe(cfg))
    index = tokenize_into(cfg, tmp_path / "out")
    ds = IndexedDataset(str(tmp_path / "gaps_text_document"))
    theirs = [np.concatenate([ds[s] for s in range(a, b)]).tolist() if b > a else []
              for a, b in zip(ds.document_indices[:-1], ds.document_indices[1:])]
    ours = shards.read(tmp_path / "out" / TOKENS_DIR, packed=False)
    assert [d.tolist() for d in ours.train] == [d for d in theirs[:27] if d]
    assert [d.tolist() for d in ours.val] == [d for d in theirs[27:] if d]
    assert (index["train"]["documents"], index["val"]["documents"]) == (18, 2)
