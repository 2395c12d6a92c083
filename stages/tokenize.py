"""tokenize: the corpus -> memory-mapped token shards (plugins/data/shards.py) and the tokenizer that made them.

Its key holds the data config, the tokenizer, the model's vocabulary (random tokens are drawn over it) and the
content of the corpus files read, so a sweep over training settings tokenizes once and an edited file tokenizes
again. With data.tokenizer=bpe the tokenizer is trained here, on the training split, and saved with the tokens.
"""
from __future__ import annotations

import time

from plugins.data import data_fingerprint, shards
from plugins.data.batcher import encoded
from storage.fsio import read_json
from stages.base import Stage, StageContext


def tokenize(ctx: StageContext) -> None:
    t0 = time.perf_counter()
    splits, vocab, pad, tokenizer = encoded(ctx.cfg)
    seconds = time.perf_counter() - t0
    kind = tokenizer.kind if tokenizer else ctx.cfg.data.name
    index = shards.write(ctx.out / "tokens", splits, vocab, tokenizer.eos if tokenizer else pad, pad, kind)
    if tokenizer is not None:
        tokenizer.save(ctx.out / "tokenizer")
    tokens = index["train"]["tokens"] + index["val"]["tokens"]
    ctx.tracker.log_metrics({"tokenize_s": seconds, "tokens": tokens, "tokens_per_s": tokens / max(seconds, 1e-9),
                             "train_tokens": index["train"]["tokens"], "val_tokens": index["val"]["tokens"]})
    ctx.log.info("tokenized %d documents into %d + %d tokens (%s, vocabulary %d) in %.1f s: %.0f tokens/s",
                 index["train"]["documents"] + index["val"]["documents"], index["train"]["tokens"],
                 index["val"]["tokens"], kind, vocab, seconds, tokens / max(seconds, 1e-9))


def _summary(out) -> str:
    index = read_json(out / "tokens" / shards.INDEX)
    return (f"{index['train']['tokens']:,} + {index['val']['tokens']:,} tokens ({index['tokenizer']}, "
            f"vocabulary {index['vocab_size']:,})")


STAGE = Stage(
    name="tokenize",
    run=tokenize,
    reads=("data", "model.vocab_size"),
    fingerprint=data_fingerprint,
    summary=_summary,
)
