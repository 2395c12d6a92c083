"""The objective's rules: a preference objective trains on preference pairs and they on it, a batch holds whole
pairs on every rank and microbatch, and what it cannot run with yet is refused before launch."""
from __future__ import annotations

from common.problem import Problem


def check(cfg) -> list[Problem]:
    o, d, p, t = cfg.objective, cfg.data, cfg.parallel, cfg.train
    pairs = d.get("format") == "preference"
    if o.name == "sft" and pairs:
        return [Problem("data.format", d.format, "preference pairs (a chosen and a rejected completion) are learned "
                        "by comparing them: objective=sft would learn both completions as answers",
                        "objective=dpo, or data.format=prompt_completion with the chosen completions")]
    if o.name != "dpo":
        return []
    if not pairs:
        return [Problem("objective.name", o.name, f"objective=dpo compares each pair's chosen and rejected "
                        f"completion; data.format={d.format} has no pairs", "data=preference "
                        "'data.paths=[pairs.jsonl]' (records of prompt, chosen, rejected), or objective=sft")]
    problems = []
    if d.packing:
        problems.append(Problem("data.packing", d.packing, "a preference pair is two rows of one document each "
                                "(chosen and rejected side by side, on one rank), never packed with others",
                                "data.packing=false (data=preference sets it)"))
    split = p.dp * p.microbatches
    if t.batch_size % (2 * split):
        problems.append(Problem("train.batch_size", t.batch_size, f"a batch of pairs is split into parallel.dp="
                                f"{p.dp} ranks x parallel.microbatches={p.microbatches} microbatches, each holding "
                                f"whole pairs (two rows each): it must be divisible by {2 * split}",
                                f"train.batch_size={max(1, t.batch_size // (2 * split)) * 2 * split}"))
    if cfg.engine.name != "torch":
        problems.append(Problem("engine.name", cfg.engine.name, "the preference objective and its reference pass "
                                "are built and checked against TRL on the torch engine only; "
                                f"engine={cfg.engine.name} is not yet", "engine=torch"))
    return problems
