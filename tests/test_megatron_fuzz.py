"""Fuzz Megatron corpora, as plugins/data/indexed_dataset.write_index writes them: ids below 0 or past the vocabulary,
empty documents, splits shorter than a row, signed and unsigned dtypes, read as a stream or as documents. Each is
refused before launch (the data rules) or read document for document. As tests/test_data_fuzz.py: Hypothesis draws
the cases, CI runs a fixed, derandomized set of EXAMPLES, `FUZZ=all` ten times as many."""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from plugins.data.corpus import tokenized
from plugins.data.rules import check
from tests.conftest import make_cfg
from tests.test_data_fuzz import EXAMPLES

MEGATRON_VOCAB = 64  # the tokenizer folder's size: an id at or past it, or below 0, is refused
MEG_ROW = 5          # train.seq_len+1 of these cases


@pytest.fixture(scope="module")
def megatron_configs(tmp_path_factory) -> tuple[Path, dict]:
    """A tokenizer folder of MEGATRON_VOCAB tokens, and the configs that read the prefix folder/fuzz_text_document
    (packed, and as documents): composed once, as each case only writes the files again."""
    from tokenizers import Tokenizer, models

    folder = tmp_path_factory.mktemp("megatron_fuzz")
    vocab = {**{f"<{i}>": i for i in range(MEGATRON_VOCAB - 1)}, "<|endoftext|>": MEGATRON_VOCAB - 1}
    Tokenizer(models.WordLevel(vocab=vocab, unk_token="<0>")).save(str(folder / "tokenizer.json"))
    return folder, {packing: make_cfg("data=megatron", f"data.paths=[{folder / 'fuzz_text_document'}]",
                                      f"data.tokenizer=hf:{folder}", f"data.packing={str(packing).lower()}",
                                      f"train.seq_len={MEG_ROW - 1}", "train.batch_size=1", "train.eval_batches=1",
                                      "data.val_fraction=0.5", runs_dir=folder / "runs") for packing in (True, False)}


@st.composite
def megatron_cases(draw):
    """Documents of 0 to 12 ids (a quarter of them empty), an id now and then below 0 or past the vocabulary,
    in a signed or unsigned dtype, read as a stream or as documents."""
    document = st.lists(st.integers(0, MEGATRON_VOCAB - 1), min_size=1, max_size=12)
    documents = draw(st.lists(st.one_of(st.just([]), document, document, document), min_size=1, max_size=10))
    bad = draw(st.sampled_from([None] * 12 + [-1, -7, MEGATRON_VOCAB, 300]))
    held = [i for i, d in enumerate(documents) if d]
    if bad is not None and held:  # one id of one document
        d = documents[draw(st.sampled_from(held))]
        d[draw(st.integers(0, len(d) - 1))] = bad
    dtype = draw(st.sampled_from(["int32", "uint16", "int16"]))
    return documents, dtype, draw(st.booleans())


def megatron_expected(documents: list[list[int]], packing: bool) -> tuple | None:
    """The splits training reads (each prefix's last half of documents held out, one at least, never all: the
    Megatron split at data.val_fraction=0.5), or None: refused before launch."""
    n = len(documents)
    if n < 2 or any(not 0 <= i < MEGATRON_VOCAB for d in documents for i in d):
        return None
    cut = n - min(max(round(n * 0.5), 1), n - 1)
    splits = [[d for d in documents[:cut] if d], [d for d in documents[cut:] if d]]
    if packing:
        streams = [[i for d in s for i in d] for s in splits]
        return tuple(streams) if min(len(s) for s in streams) >= MEG_ROW else None
    return tuple(splits) if all(splits) else None


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=megatron_cases())
def test_every_megatron_corpus_trains_its_documents_or_is_refused_before_launch(megatron_configs, case):
    """Ids below 0 or past the vocabulary, empty documents and splits shorter than a row, from files
    plugins/data/indexed_dataset.write_index indexes: refused before launch (the data rules), else the splits training
    reads are the documents with ids, in order (a stream of them where packed)."""
    import numpy as np

    from plugins.data.indexed_dataset import write_index

    documents, dtype, packing = case
    folder, configs = megatron_configs
    tokens = np.array([i for d in documents for i in d], dtype=np.int64)
    dtype = "int32" if np.dtype(dtype).kind == "u" and len(tokens) and tokens.min() < 0 else dtype  # signed for -1
    (folder / "fuzz_text_document.bin").write_bytes(tokens.astype(dtype).tobytes())
    write_index(str(folder / "fuzz_text_document"), dtype, [len(d) for d in documents])
    cfg = configs[packing]
    problems = check(cfg)
    wanted = megatron_expected(documents, packing)
    event("refused" if wanted is None else "packed" if packing else "documents")  # --hypothesis-show-statistics
    if wanted is None:
        assert problems and all(p.key.startswith(("data.", "train.")) and p.rule and p.fix for p in problems), case
        return
    assert not problems, (case, problems)
    corpus = tokenized(cfg)
    ours = ([c.tolist() for c in corpus.train], [c.tolist() for c in corpus.val])
    assert ours == ((([wanted[0]], [wanted[1]])) if packing else wanted), case
