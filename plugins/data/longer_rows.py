"""The fix "longer rows" where a document is longer than a row: a train.seq_len the model has positions for, else
what else must grow with it, so that the fix offered is not refused in turn (train.seq_len <= model.max_seq_len)."""
from __future__ import annotations


def longer_rows(cfg, seq_len: int) -> str:
    if seq_len <= cfg.model.max_seq_len:
        return f"train.seq_len={seq_len} or more"
    return f"a model of {seq_len} positions or more (model.max_seq_len), with train.seq_len as long"
