"""Preference pairs as data, whatever the objective that learns from them: a batch's rows of pairs side by side,
dealt to ranks whole with each row's per-row input; the held-out text the evaluate stage scores and prompts with is
each pair's chosen document."""
from __future__ import annotations


def test_a_batch_of_pairs_keeps_each_pair_in_two_rows_side_by_side_on_one_rank_with_its_reference():
    """Rows 2r and 2r+1 hold documents 2k and 2k+1 from their start (a pair's chosen and rejected), dealt to two
    data-parallel ranks by real tokens a pair at a time, each row with its document's reference log-probability."""
    import numpy as np

    from plugins.data.batcher import Batcher
    from plugins.data.registry import Corpus

    rng = np.random.default_rng(0)
    docs = [np.arange(100 * i, 100 * i + n) for i, n in enumerate(rng.integers(3, 40, 60))]
    reference = {"train": -rng.random(60) * 50, "val": -rng.random(4) * 50}
    corpus = Corpus(docs, docs[:4], 6000, packed=False, pad=-5)
    batcher = Batcher(corpus, 8, 24, seed=1, ranks=2, balance_ranks=True, pairs=True, row_inputs=reference)
    for step in range(20):
        batch = batcher.train_batch(step)
        assert (batch.drawn[0::2] % 2 == 0).all() and (batch.drawn[1::2] == batch.drawn[0::2] + 1).all()
        assert batch.row_inputs.tolist() == reference["train"][batch.drawn].tolist()
        for row, doc in zip(batch.inputs.tolist(), batch.drawn):
            length = min(len(docs[doc]), 24)
            assert row[:length] == docs[doc][:length].tolist() and set(row[length:]) <= {-5}
        assert batch.drawn.tolist() == batcher.train_batch(step).drawn.tolist()  # a function of (seed, step)
    assert len({tuple(batcher.train_batch(s).drawn) for s in range(20)}) == 20
    balanced = [abs(int(t[0]) - int(t[1])) for t in (batcher.train_batch(s).real.reshape(2, -1).sum(1)
                                                      for s in range(20))]
    plain = Batcher(corpus, 8, 24, seed=1, pairs=True)
    assert sum(balanced) < sum(abs(int(t[0]) - int(t[1])) for t in (plain.train_batch(s).real.reshape(2, -1).sum(1)
                                                                      for s in range(20)))


def test_val_perplexity_and_the_generations_read_the_chosen_completions_only(tmp_path):
    """The held-out text the evaluate stage scores (val_perplexity) and prompts with (its generations) is each pair's
    chosen document: the rejected answers are no text the model should write."""
    import json

    from plugins.data.corpus import tokenize_into
    from plugins.evaluate import validation
    from plugins.objectives.spec import rows_per_example
    from tests.conftest import make_cfg

    records = [{"prompt": f"{a}+{a}=", "chosen": f" {2 * a}", "rejected": f" {2 * a + 1}"} for a in range(40)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = make_cfg("objective=dpo", "data=preference", f"data.paths=[{tmp_path / 'pairs.jsonl'}]",
                   "data.val_fraction=0.25", runs_dir=tmp_path)
    tokenize_into(cfg, tmp_path / "out")
    assert rows_per_example(cfg) == 2 and rows_per_example(make_cfg()) == 1
    n = validation.write_documents(tmp_path / "out", tmp_path / "val.jsonl", None, rows_per_example(cfg))
    texts = [json.loads(line)["text"] for line in (tmp_path / "val.jsonl").read_text().splitlines()]
    assert n == len(texts) > 0
    for text in texts:
        a = int(text.split("+")[0])
        assert text.endswith(f" {2 * a}")  # the chosen sum, never the near miss
    answers = validation.prompts(tmp_path / "out", 100, stride=rows_per_example(cfg))
    assert len(answers) == n
