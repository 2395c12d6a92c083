"""The export and transform stages' preconditions, checked with the plan: the passes named exist, the export's check
can pass, and its example input fits in memory (planning/plan.py compares example_bytes with what a stage may use)."""
from __future__ import annotations

import difflib

from common.problem import Problem



def check(cfg) -> list[Problem]:
    from plugins.onnx.passes import PASSES

    problems = []
    unknown = [n for n in cfg.transform.passes if n not in PASSES]
    if unknown:
        close = {n: difflib.get_close_matches(str(n), list(PASSES), n=1) for n in unknown}
        hint = "; ".join(f"{n}: did you mean {c[0]}?" for n, c in close.items() if c)
        problems.append(Problem("transform.passes", list(cfg.transform.passes), f"no ONNX pass is named "
                                f"{', '.join(map(str, unknown))} (the passes: {', '.join(sorted(PASSES))})",
                                (hint + "; " if hint else "") + f"transform.passes=[{', '.join(sorted(PASSES))}] "
                                "or [] for none"))
    if cfg.export.verify_atol == 0:
        problems.append(Problem("export.verify_atol", 0, "0 asks ONNX Runtime and torch to agree to the last bit; "
                                "two runtimes sum in different orders, so the export check would always fail",
                                "export.verify_atol=1e-4 (the default)"))
    return problems


def example_tokens(cfg) -> tuple[int, int]:
    """(batch, sequence) of the input the export's check runs (plugins/onnx/exporter.py)."""
    e = cfg.export
    return e.sample_batch + 1, min(2 * e.sample_seq + 3, cfg.model.max_seq_len)


def example_bytes(cfg, batch: int = 0) -> int:
    """What the export's check holds for its example input, in torch and in ONNX Runtime at once: the logits,
    a few hidden states and one layer's attention scores, each fp32 (batch: instead of export.sample_batch + 1)."""
    from plugins.models.registry import vocab_rows

    b, s = example_tokens(cfg)
    b = batch or b
    m = cfg.model
    per_sequence = s * (vocab_rows(m) + 4 * max(m.d_model, m.d_ff)) * 4 + m.n_heads * s * s * 4
    return 2 * b * per_sequence
