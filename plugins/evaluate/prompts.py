"""The user's tasks as the model will read them, checked before launch: prompts that fit its positions, answers
its tokenizer can spell.

Prompts. 
lm-eval puts `num_fewshot` examples before each question and, where the context and an answer are longer than the
model's positions, cuts the context from its left (HFLM: `(context + continuation)[-(max_length + 1):]`) without a
word: the examples first, then the question. The results still say "32-shot" (measured: 32-shot arith_mc on a
128-position model cut 307 of 431 context tokens from every question). So each loglikelihood task that draws
examples is built here by lm-eval (its TaskManager, its few-shot sampler seeded as the stage seeds it), its first
questions' prompts rendered as lm-eval renders them, and counted with the run's tokenizer (bytes, or an hf: folder's;
a BPE is learned by the tokenize stage, after launch, and is not counted). A prompt that does not fit is refused,
naming the largest number of examples that does.

Answers. A tokenizer that has no tokens for an answer's characters (a WordPiece vocabulary without digits: every
number one [UNK]) makes the choices of a question the same tokens, and lm-eval scores the tie as it falls (measured:
0.35 on arith_mc, a number that means nothing). Where most answers of a task's first questions hold the tokenizer's
unknown token, the plan says so.
"""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Callable, Optional

from common.problem import Problem
from plugins.evaluate.harness import SHIPPED, local_tasks, task_configs, task_yaml

QUESTIONS = 4          # the first questions of each task whose prompts are counted
CHOICES = ("multiple_choice", "loglikelihood")  # answers after a prompt: what HFLM cuts from the left (rolling: none)


def problems(cfg) -> list[Problem]:
    """Few-shot prompts longer than the model's positions."""
    ev, positions = cfg.evaluate, cfg.model.max_seq_len
    count = _counter(cfg.data)
    if count is None or not ev.tasks:
        return []
    out = []
    for name, task in loglikelihood_tasks(ev):
        shots = ev.num_fewshot or task.config.num_fewshot or 0
        if not shots:
            continue
        task.set_fewshot_seed(seed=ev.seed)
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
    if d.tokenizer == "bytes":
        return lambda text: len(text.encode("utf-8"))
    tok = _hf_tokenizer(d)
    return None if tok is None else lambda text: len(tok.bos) + len(tok.encode([text.encode("utf-8")])[0])


def _hf_tokenizer(d):
    """data.tokenizer's hf: folder loaded (None: another kind, or one the data rules refuse)."""
    from plugins.data import tokenizer as tokenizers

    if tokenizers.hf_folder(d.tokenizer) is None:
        return None
    try:
        return tokenizers.make(d)
    except (OSError, ValueError):
        return None


def warnings(cfg) -> list[str]:
    """Tasks whose answers are mostly the tokenizer's unknown token (an hf: tokenizer with one)."""
    ev = cfg.evaluate
    unknown = _unknown(cfg.data) if ev.tasks else None
    if unknown is None:
        return []
    notes = []
    for name, task in loglikelihood_tasks(ev):
        answers = [a for doc in _first(task) for a in _answers(task, doc)]
        spelt = [unknown(a) for a in answers]
        if answers and sum(spelt) * 2 > len(answers):
            notes.append(f"warning: evaluate: {sum(spelt)} of the {len(answers)} answers of {name}'s first "
                         f"{QUESTIONS} questions hold data.tokenizer's unknown token ({cfg.data.tokenizer}): their "
                         "choices look alike to the model, and the score would not tell them apart (a tokenizer "
                         "whose vocabulary spells them, or another task)")
    return notes


def _unknown(d) -> Optional[Callable[[str], bool]]:
    """Whether a text holds the run's tokenizer's unknown token (None: a tokenizer without one, bytes and BPE)."""
    tok = _hf_tokenizer(d)
    if tok is None:
        return None
    token = getattr(tok.backend.model, "unk_token", None)
    unk = tok.backend.token_to_id(token) if isinstance(token, str) else None
    if unk is None:
        return None
    return lambda text: unk in tok.encode([text.encode("utf-8")])[0]


def loglikelihood_tasks(ev):
    """(name, lm-eval's task) of each local loglikelihood task of evaluate.tasks, built by lm-eval's TaskManager."""
    import datasets
    from lm_eval.tasks import TaskManager

    local = {**local_tasks(SHIPPED), **(local_tasks(Path(ev.include_path).expanduser()) if ev.include_path else {})}
    manager = TaskManager(include_path=str(Path(ev.include_path).expanduser()) if ev.include_path else None,
                          include_defaults=False)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        for name, spec in zip(ev.tasks, task_configs(ev, {})):
            if name not in local or task_yaml(local[name]).get("output_type") not in CHOICES:
                continue  # lm-eval's own (the Hub's), or a task without examples (val_perplexity's data comes later)
            task = manager.load([spec])["tasks"].get(name)
            if task is not None and task.config.output_type in CHOICES:
                yield name, task
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
    return max((count(task.fewshot_context(doc, shots) + max(_answers(task, doc), key=len, default=""))
                for doc in _first(task)), default=0)


def _first(task) -> list:
    """The task's first QUESTIONS questions."""
    docs = task.test_docs() if task.has_test_docs() else task.validation_docs()
    return list(itertools.islice(docs or (), QUESTIONS))


def _answers(task, doc) -> list[str]:
    """A question's answers as lm-eval puts them after its prompt (the choices, or the target)."""
    choices = task.doc_to_choice(doc) if task.config.output_type == "multiple_choice" else [task.doc_to_target(doc)]
    return [f"{task.config.target_delimiter}{c}" for c in choices if isinstance(c, str)]
