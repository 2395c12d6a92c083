"""The evaluate stage: lm-eval tasks on the aggregated model."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from orchestrator.config.schema.keys import key, MAX_SEED, MAX_TOKENS, EMPTY, EVALUATING


@dataclass
class EvaluateConfig:
    tasks: List[str] = key([], "lm-evaluation-harness tasks the evaluate stage scores the aggregate's hf/ folder on, "
                               "after aggregate: ones the project ships (plugins/evaluate/tasks: arith_mc, arith_gen, "
                               "arith_chat, and val_perplexity: the run's own validation split), ones in "
                               "evaluate.include_path, or lm-eval's own where their data is reachable; [] runs no "
                               "evaluate stage")
    include_path: Optional[str] = key(None, "a folder of lm-eval task YAML files (lm-eval's --include_path); its "
                                            "files enter the stage's key, as data files do", read_when=EVALUATING)
    num_fewshot: int = key(0, "examples of the task put before each question (lm-eval's --num_fewshot)", min=0,
                           max=64, read_when=EVALUATING)
    limit: Optional[int] = key(None, "score only the first N examples of each task (None: all)", min=1,
                               read_when=EVALUATING)
    batch_size: int = key(8, "examples scored at once", min=1, max=4096, read_when=EVALUATING)
    seed: int = key(1234, "lm-eval's seeds (few-shot draws, sampling)", min=0, max=MAX_SEED,
                    read_when=EVALUATING)
    apply_chat_template: bool = key(False, "put each question in the model's own chat template, the tokenizer's "
                                           "(lm-eval's --apply_chat_template; arith_chat is made for it)",
                                    read_when=EVALUATING)
    prompts: List[str] = key([], "prompts the trained model answers (greedy) after scoring, logged as the MLflow "
                                 "table generations.json (in the chat template where the tokenizer has one); []: the "
                                 "first evaluate.generations validation prompts of a chat or prompt-completion corpus "
                                 "(a text corpus: a document's first 32 tokens)", read_when=EVALUATING)
    generations: int = key(4, "how many validation prompts are answered when evaluate.prompts is empty (0: none)",
                           min=0, max=1000, read_when=[EVALUATING, ("evaluate.prompts", EMPTY)])
    max_new_tokens: int = key(64, "the longest answer generated for a prompt, in tokens", min=1, max=MAX_TOKENS,
                              read_when=EVALUATING)
    onnx: bool = key(False, "also score the aggregate's ONNX model through ONNX Runtime on the loglikelihood tasks "
                            "(multiple choice, perplexity): the stage fails where a loglikelihood differs from hf/'s "
                            "by more than 1e-4, and records both scores (needs aggregate.onnx)",
                     read_when=EVALUATING)
