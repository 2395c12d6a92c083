"""data=synthetic: uniform random tokens over the model's vocabulary, drawn in memory (no file, no tokenizer); a
benchmark's corpus. Its stream takes 16 bytes a token while it is drawn, which the plan holds against what a stage
may use (data.synthetic_tokens)."""
from __future__ import annotations

import numpy as np

from plugins.data.registry import Corpus, DataSource, register_source


def _synthetic_tokens(cfg, model_vocab: int) -> Corpus:
    rng = np.random.default_rng(0)
    n = cfg.synthetic_tokens
    n_val = max(int(n * cfg.val_fraction), 1)
    stream = rng.integers(0, model_vocab, size=n, dtype=np.int64)
    return Corpus([stream[n_val:]], [stream[:n_val]], model_vocab, packed=True)


def _drawn_bytes(cfg) -> int:
    """8 bytes a token (int64), twice while the stream is drawn."""
    return 16 * cfg.synthetic_tokens


register_source("synthetic", DataSource(lambda cfg: "synthetic-v1", tokens=_synthetic_tokens, drawn_bytes=_drawn_bytes))
