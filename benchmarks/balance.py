"""Ranks balanced by work, and what packing without cross-talk costs (issue 36).

1. One document a row (data.packing=false), lengths long-tailed (log-normal, as chat data is), dp=2 and 4. For
   each step, each rank's real tokens (max/mean over ranks) and its forward+backward time on its share of the
   batch; a data-parallel step waits for its slowest rank, so the step time is the max over ranks. Three ways:
     plain    today's draw: each rank its consecutive rows, padded to train.seq_len
     packed   the same rows, each rank's real tokens packed into fewer rows with a document mask (repack)
     dealt    data.balance_ranks=true (the default): rows dealt by real tokens, then packed as above
   The ranks run one after another in this process (the same model and threads for each): the step time is the
   slowest rank's compute, without the gradient all-reduce (the same for every variant).
2. Rows of whole documents (data.packing_strategy=bfd) against windows of the stream (wrapped) on the same corpus,
   the same batch shape: forward+backward tokens/s, i.e. what the document mask costs on this CPU.

    python benchmarks/balance.py [model=gpt_small] [seq_len=256] [batch=32] [steps=6] [threads=2]
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.support.cli import arguments  # noqa: E402
from plugins.data.batcher import Batcher  # noqa: E402
from plugins.data.packing import rank_tokens, repack  # noqa: E402
from plugins.data.registry import Corpus  # noqa: E402
from plugins.models import get_model  # noqa: E402
from plugins.models.transformer import init_weights  # noqa: E402
from orchestrator.config.compose import compose_config  # noqa: E402


def corpus(seq_len: int, vocab: int, n: int = 4000) -> Corpus:
    """Documents of log-normal lengths (median seq_len/5, a long tail up to seq_len+1), random tokens."""
    rng = np.random.default_rng(0)
    lengths = rng.lognormal(np.log(seq_len / 5), 1.0, n).clip(8, seq_len + 1).astype(int)
    docs = [rng.integers(0, vocab - 2, n_tokens) for n_tokens in lengths]
    return Corpus(docs[:-200], docs[-200:], vocab, packed=False, pad=vocab - 1)


def timed(model, inputs, labels, documents=None) -> float:
    t0 = time.perf_counter()
    logits = model(inputs) if documents is None else model(inputs, documents=documents)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                      reduction="sum").backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def balance(model, data: Corpus, dp: int, batch: int, seq_len: int, steps: int) -> dict:
    plain = Batcher(data, batch, seq_len, seed=0)
    dealt = Batcher(data, batch, seq_len, seed=0, ranks=dp, balance_ranks=True)
    out = {v: {"spread": [], "step": []} for v in ("plain", "packed", "dealt")}
    for step in range(steps + 1):  # step 0 warms up
        for variant, batcher in (("plain", plain), ("packed", plain), ("dealt", dealt)):
            b = batcher.train_batch(step)
            per_rank = []
            for r in range(dp):
                rows = slice(r * batch // dp, (r + 1) * batch // dp)
                x, y = b.inputs[rows], b.labels[rows]
                per_rank.append(timed(model, x, y) if variant == "plain" else
                                timed(model, *repack(x, y, b.real[rows], multiple=8)))
            if step:
                tokens = rank_tokens(b.real, dp)
                out[variant]["spread"].append(tokens.max() / tokens.mean())
                out[variant]["step"].append(max(per_rank))
    return {v: (statistics.mean(o["spread"]), statistics.median(o["step"])) for v, o in out.items()}


def mask_cost(model, data: Corpus, batch: int, seq_len: int, steps: int) -> dict:
    stream = Corpus([np.concatenate(data.train)], [np.concatenate(data.val)], data.vocab_size, packed=True,
                    pad=data.pad)
    kinds = {"wrapped": Batcher(stream, batch, seq_len, seed=0), "bfd": Batcher(data, batch, seq_len, seed=0,
                                                                                 whole_documents="split")}
    seconds = {k: [] for k in kinds}
    for step in range(steps + 1):
        for kind, batcher in kinds.items():
            b = batcher.train_batch(step)
            t = timed(model, b.inputs, b.labels, b.documents)
            if step:
                seconds[kind].append(t)
    return {k: batch * seq_len / statistics.median(v) for k, v in seconds.items()}


def main() -> None:
    a = arguments(sys.argv[1:], __doc__)
    seq_len, batch, steps = int(a.get("seq_len", 256)), int(a.get("batch", 32)), int(a.get("steps", 6))
    torch.set_num_threads(int(a.get("threads", 2)))
    cfg = compose_config(f"model={a.get('model', 'gpt_small')}")
    model = get_model(cfg.model.name).build(cfg.model)
    init_weights(model, cfg.model, seed=0)
    data = corpus(seq_len, cfg.model.vocab_size)
    print(f"model={a.get('model', 'gpt_small')}, seq_len={seq_len}, batch={batch}, {torch.get_num_threads()} threads; "
          f"documents: median {int(np.median([len(d) for d in data.train]))} tokens, "
          f"max {max(len(d) for d in data.train)}")
    print("| dp | variant | real tokens max/mean over ranks | step s (slowest rank) | vs plain |")
    print("| --- | --- | --- | --- | --- |")
    for dp in (2, 4):
        results = balance(model, data, dp, batch, seq_len, steps)
        for variant, (spread, seconds) in results.items():
            print(f"| {dp} | {variant} | {spread:.2f} | {seconds:.3f} | {results['plain'][1] / seconds:.2f}x |")
    rates = mask_cost(model, data, batch, seq_len, steps)
    print(f"rows of whole documents (bfd, document mask) {rates['bfd']:,.0f} tokens/s vs windows of the stream "
          f"(wrapped, causal only) {rates['wrapped']:,.0f} tokens/s: {rates['bfd'] / rates['wrapped']:.2f}x")


if __name__ == "__main__":
    main()
