"""Few-shot prompts that fit the model's positions, checked before launch.

lm-eval puts `num_fewshot` examples before each question and, where the context and an answer are longer than the
model's positions, cuts the context from its left (HFLM: `(context + continuation)[-(max_length + 1):]`) without a
word: the examples first, then the question. The results still say "32-shot" (measured: 32-shot arith_mc on a
128-position model cut 307 of 431 context tokens from every question). So each loglikelihood task that draws
examples is built here by lm-eval (its TaskManager, its few-shot sampler seeded as the stage seeds it), its first
questions' prompts rendered as lm-eval renders them, and counted with the run's tokenizer (bytes, or an hf: folder's;
a BPE is learned by the tokenize stage, after launch, and is not counted). A prompt that does not fit is refused,
naming the largest number of examples that does.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from common.problem import Problem
from plugins.evaluate.harness import SHIPPED, local_tasks, task_configs, task_yaml

QUESTIONS = 4          # the first questions of each task whose prompts are counted
LOGLIKELIHOOD = ("multiple_choice", "loglikelihood")  # the kinds HFLM cuts from the left (rolling has no examples)


def problems(cfg) -> list[Problem]:
    ev, positions = cfg.evaluate, cfg.model.max_seq_len
    count = _counter(cfg.data)
    if count is None:
        return []
    out = []
    for name, task, shots in _tasks_with_examples(ev):
        longest = _longest(task, shots, count)
        if longest <= positions + 1:
            continue
        fits = _most_that_fit(task, shots, count, positions + 1)
        key = "evaluate.num_fewshot" if ev.num_fewshot else "evaluate.tasks"
        out.append(Problem(key, ev.num_fewshot or name, f"{shots}-shot prompts of {name} hold up to {longest:,} "
                           f"tokens with an answer (its first {QUESTIONS} questions, data.tokenizer="
                           f"{cfg.data.tokenizer}), and the model reads {positions:,} (model.max_seq_len): lm-eval "
                           f"would cut {longest - positions - 1:,} tokens from the left of such prompts, its examples "
                           f"first, and still report them as {shots}-shot",
                           (f"evaluate.num_fewshot={fits} (the most examples that fit)" if fits is not None else
                            "shorter questions") + ", or a model with more positions (model.max_seq_len)"))
    return out


def _counter(d) -> Optional[Callable[[str], int]]:
    """Tokens of a text with the run's tokenizer (None where it is learned after launch)."""
    from plugins.data import tokenizer as tokenizers

    if d.tokenizer == "bytes":
        return lambda text: len(text.encode("utf-8"))
    if tokenizers.hf_folder(d.tokenizer) is None:
        return None
    try:
        tok = tokenizers.make(d)
    except (OSError, ValueError):  # the data rules say what is wrong with it
        return None
    return lambda text: len(tok.bos) + len(tok.encode([text.encode("utf-8")])[0])


def _tasks_with_examples(ev):
    """(name, lm-eval's task, examples) of each local loglikelihood task that puts examples before its questions."""
    import datasets
    from lm_eval.tasks import TaskManager

    local = {**local_tasks(SHIPPED), **(local_tasks(Path(ev.include_path).expanduser()) if ev.include_path else {})}
    manager = TaskManager(include_path=str(Path(ev.include_path).expanduser()) if ev.include_path else None,
                          include_defaults=False)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        for name, spec in zip(ev.tasks, task_configs(ev, {})):
            if name not in local or task_yaml(local[name]).get("output_type") not in LOGLIKELIHOOD:
                continue  # lm-eval's own (the Hub's), or a task without examples (val_perplexity's data comes later)
            task = manager.load([spec])["tasks"].get(name)
            if task is None or task.config.output_type not in LOGLIKELIHOOD:
                continue
            shots = ev.num_fewshot or task.config.num_fewshot or 0
            if shots:
                task.set_fewshot_seed(seed=ev.seed)
                yield name, task, shots
    finally:
        if bars:
            datasets.enable_progress_bars()


def _most_that_fit(task, shots: int, count: Callable[[str], int], limit: int) -> Optional[int]:
    """The most examples (fewer than `shots`) whose prompts fit `limit` tokens, by bisection (lm-eval compiles its
    templates again at each rendering: a prompt of 32 examples takes 40 ms); None where none fits."""
    if _longest(task, 0, count) > limit:
        return None
    low, high = 0, shots - 1  # low fits
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if _longest(task, middle, count) <= limit else (low, middle - 1)
    return low


def _longest(task, shots: int, count: Callable[[str], int]) -> int:
    """The most tokens of a prompt with its longest answer, over the first QUESTIONS questions."""
    docs = task.test_docs() if task.has_test_docs() else task.validation_docs()
    longest = 0
    for i, doc in enumerate(docs or ()):
        if i >= QUESTIONS:
            break
        context = task.fewshot_context(doc, shots)
        choices = task.doc_to_choice(doc) if task.config.output_type == "multiple_choice" else [task.doc_to_target(doc)]
        answer = max((f"{task.config.target_delimiter}{c}" for c in choices if isinstance(c, str)), key=len,
                     default="")
        longest = max(longest, count(context + answer))
    return longest
