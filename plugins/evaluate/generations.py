"""What the trained model answers: greedy generations for the user's prompts (evaluate.prompts, put in the chat
template where the tokenizer has one) or for the run's first validation prompts (plugins/evaluate/validation.py,
token ids as trained, with the records' own answers beside), as a table of prompt, answer and reference."""
from __future__ import annotations

import torch


def user_prompts(tokenizer, texts: list[str]) -> list[tuple[list[int], list[int]]]:
    """The user's prompts as ids: a user turn in the tokenizer's chat template with the assistant's header after it
    (a chat model's form), else the text as it is. No reference answer."""
    out = []
    for text in texts:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        out.append(([int(i) for i in ids], []))
    return out


@torch.no_grad()
def answer(model, tokenizer, prompts: list[tuple[list[int], list[int]]], max_new_tokens: int) -> dict[str, list]:
    """Each prompt's greedy continuation, to <eos> or max_new_tokens (fewer where the prompt nears the model's
    longest sequence; a longer prompt keeps its last tokens): the columns prompt, answer, reference."""
    longest = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    table: dict[str, list] = {"prompt": [], "answer": [], "reference": []}
    for ids, reference in prompts:
        new = max_new_tokens
        if longest is not None:  # the answer fits the model's positions: all the room the prompt leaves, or half
            new = min(new, longest - len(ids) if len(ids) < longest else longest // 2)
            ids = ids[-(longest - new):]
        given = torch.tensor([ids], device=model.device)
        made = model.generate(given, attention_mask=torch.ones_like(given), max_new_tokens=new, do_sample=False,
                              eos_token_id=eos, pad_token_id=pad if pad is not None else eos)
        table["prompt"].append(tokenizer.decode(ids, skip_special_tokens=False))
        table["answer"].append(tokenizer.decode(made[0, len(ids):].tolist(), skip_special_tokens=True))
        table["reference"].append(tokenizer.decode(reference, skip_special_tokens=True))
    return table
