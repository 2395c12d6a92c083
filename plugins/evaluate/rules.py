"""evaluate.*'s checks before launch: the tasks (plugins/evaluate/harness.py), and what the other stages must make
for the evaluate stage to read it (a tokenizer, a chat template, an ONNX model)."""
from __future__ import annotations

from common.problem import Problem
from plugins.data.registry import get_source
from plugins.data.tokenizer import chat_template
from plugins.evaluate.prompts import problems as prompt_problems
from plugins.evaluate.harness import problems
from plugins.evaluate.task_check import problems as task_problems


def check(cfg) -> list[Problem]:
    ev = cfg.evaluate
    if not ev.tasks:
        return []
    out = problems(ev)
    if not out:
        out = task_problems(ev)
    if not out:
        out = prompt_problems(cfg)
    if get_source(cfg.data.name).tokens is not None:
        out.append(Problem("evaluate.tasks", list(ev.tasks), f"data.name={cfg.data.name} is tokens with no tokenizer, "
                           "and lm-eval scores text (the hf/ folder would have no tokenizer)", "a text corpus "
                           "(data.name=local data.paths=[...], or the default), or evaluate.tasks=[]"))
    elif ev.apply_chat_template and _template(cfg) is None:
        out.append(Problem("evaluate.apply_chat_template", True, "the run's tokenizer has no chat template to put the "
                           "questions in", "data.chat_template=<a template or its file>, a data.tokenizer=hf:<folder> "
                           "with one, or evaluate.apply_chat_template=false"))
    if ev.onnx and not cfg.aggregate.onnx:
        out.append(Problem("evaluate.onnx", True, "the aggregate writes no ONNX model (aggregate.onnx=false)",
                           "aggregate.onnx=true, or evaluate.onnx=false"))
    for prompt in ev.prompts:
        if not prompt.strip():
            out.append(Problem("evaluate.prompts", prompt, "an empty prompt: nothing to answer",
                               "a question or an instruction, as the model's users would write it"))
    return out


def _template(cfg):
    try:
        return chat_template(cfg.data)
    except (OSError, ValueError, KeyError):  # data's own checks name the template's fault
        return None
