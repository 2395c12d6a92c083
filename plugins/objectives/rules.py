"""The checks every objective's config goes through, asked of its spec (plugins/objectives/spec.py): its rows and
the records (pairs for an objective on pairs, and pairs for nothing else), what rows of pairs need of the layout, what
its per-row inputs need, then its own rules."""
from __future__ import annotations

from common.problem import Problem
from plugins.objectives.pairs import pair_rules
from plugins.objectives.reference import needs_reference
from plugins.objectives.spec import PAIR, get_objective, objective_names

# what the records of a format an objective learns from are called, where a file of them is, and what each holds:
# for the refusal and the fix that names them
FORMAT_WORDS = {"preference": ("pairs", "pairs.jsonl", "records of prompt, chosen, rejected"),
                "unpaired": ("labelled completions", "feedback.jsonl", "records of prompt, completion, label")}


def check(cfg) -> list[Problem]:
    o, d = cfg.objective, cfg.data
    spec = get_objective(o.name)
    chosen = _option_of(o)
    if chosen is not None and chosen != o.name:  # objective.name=dpo over objective=sft's keys
        return [Problem("objective.name", o.name, f"objective.name renames the objective, but its keys are still "
                        f"objective={chosen}'s: objective={o.name}'s own keys and defaults come with its option",
                        f"objective={o.name} (the option, not objective.name=)")]
    fmt = d.get("format", "text")
    if fmt not in spec.formats:
        takers = [n for n in objective_names() if fmt in get_objective(n).formats]
        reads = " or ".join(f"data.format={f}" for f in spec.formats)
        if "text" in spec.formats and takers:  # an objective of any text (sft) on records others compare
            return [Problem("data.format", fmt, f"{fmt} records are learned by comparing what each holds "
                            f"(objective={' or '.join(takers)}): objective={o.name} would learn every completion as "
                            f"an answer", f"objective={takers[0]}" + (f" (or {', '.join(takers[1:])})" if takers[1:]
                                                                       else "") + ", or data.format=prompt_completion "
                            "with the completions to learn")]
        noun, file, holds = FORMAT_WORDS.get(spec.formats[0], ("records", "records.jsonl", "its records"))
        return [Problem("objective.name", o.name, f"objective={o.name} learns from {reads} records; data.format="
                        f"{fmt} has no {noun}", f"data={spec.formats[0]} 'data.paths=[{file}]' ({holds}), or "
                        "objective=sft")]
    problems = pair_rules(cfg) if spec.rows == PAIR else []
    if d.get("mix") and (spec.rows == PAIR or spec.mismatched(o)):  # one corpus's examples side by side, or rotated
        problems.append(Problem("data.mix", f"{len(d.mix)} sources", f"objective={o.name} draws "
                                + ("whole pairs" if spec.rows == PAIR else "each record's prompt with another "
                                   "record's completion in the batch") + " from one corpus; a data.mix draws each "
                                "row's source by weight", "one corpus: data.paths= every file of "
                                f"{FORMAT_WORDS.get(spec.formats[0], ('records',))[0]} (drop data.mix)"))
    if needs_reference(cfg) and cfg.train.steps == 0:  # the policy is its reference: nothing can be measured
        problems.append(Problem("objective.name", o.name, "train.steps=0 takes no step, so the policy is its own "
                                "reference: the reference pass would run for nothing and every pair's loss would be "
                                "its value at the reference (log 2 for dpo) whatever the weights, which measures "
                                "nothing of them", "train.steps=300 to train on the pairs; a baseline of the starting "
                                "weights (evaluate.tasks) is objective=sft with data=text"))
    return problems + list(spec.rules(cfg))


def _option_of(o):
    """The objective whose config the section was composed from (None where it is not a structured one)."""
    from omegaconf import OmegaConf

    kind = OmegaConf.get_type(o) if OmegaConf.is_config(o) else None
    return next((n for n in objective_names() if get_objective(n).config is kind), None)
