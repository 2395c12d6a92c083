"""Reasoning models' own templates (Qwen3's, DeepSeek-R1's, tests/data/chat_templates) fine-tuned as they are read at
inference: their renderings of a conversation drop earlier turns' reasoning, so each assistant turn is its own
example (data.chat_turns=auto), the history as the template renders it there and the turn's reasoning and answer
learned. Each example's ids and mask equal transformers' apply_chat_template on the conversation up to that turn
with a tagged copy of the template (the last turn's tags: what the model writes after the generation prompt)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from plugins.data.reasoning import as_template_reads, reasoning_of, written

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
SPECIAL = {"qwen3": (None, "<|im_end|>"), "deepseek-r1": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")}
OTHERS = ["<|im_start|>", "<｜User｜>", "<｜Assistant｜>"]
THINKING = ["<think>", "</think>"]  # added tokens, not special ones, in both families' tokenizers
ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}
CHATS = {
    "reasoning-field": [{"role": "user", "content": "What is 2+2?"},
                        {"role": "assistant", "content": "4.", "reasoning_content": "Two and two make four."}],
    "reasoning-inline": [{"role": "user", "content": "What is 2+2?"},
                         {"role": "assistant", "content": "<think>\nTwo and two.\n</think>\n\n4."}],
    "reasoning-quotes-answer": [{"role": "user", "content": "What is 2+2?"},  # the answer's text in its reasoning
                                {"role": "assistant", "content": "<think>\nTwo and two make 4.\n</think>\n\n4."}],
    "system-two-turns": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
                         {"role": "assistant", "content": "Blue.", "reasoning_content": "The sea is blue."},
                         {"role": "user", "content": "Another?"},
                         {"role": "assistant", "content": "Green.", "reasoning_content": "Grass is green."}],
    "no-reasoning": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                     {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye now."}],
    "tool-call-with-reasoning": [  # one user query, two steps: the first step's reasoning stays in the history
        {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "content": "", "reasoning_content": "I should call add.", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "2 + 3 = 5.", "reasoning_content": "The tool said 5."}],
}


@pytest.fixture(scope="module", params=["think-added", "think-special"])
def tokenizer(request):
    """A byte-level BPE with both families' special tokens; <think> and </think> added as the models' tokenizers
    add them (not special), or special, as a user's tokenizer may make them (a stop inside the turn)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = sorted({t for pair in SPECIAL.values() for t in pair if t} | set(OTHERS))
    texts = [m["content"] + m.get("reasoning_content", "") for chat in CHATS.values() for m in chat] * 20
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    (tok.add_special_tokens if request.param == "think-special" else tok.add_tokens)(THINKING)
    return tok


def _ours(tokenizer, family: str, template: str):
    from plugins.data.tokenizer import Tokenizer

    bos, eos = SPECIAL[family]
    return Tokenizer("hf", 400, tokenizer.token_to_id(eos), tokenizer.token_to_id(eos), tokenizer, template,
                     {"bos_token": bos, "eos_token": eos})


def _last_run(mask: list[int]) -> list[int]:
    """The mask's last run of ones alone (the tagged copy marks every assistant turn it renders; the example
    learns its last)."""
    end = max(i for i, m in enumerate(mask) if m) + 1
    start = max((i + 1 for i in range(end) if not mask[i]), default=0)
    return [int(start <= i < end) for i in range(len(mask))]


@pytest.mark.parametrize("family", sorted(SPECIAL))
def test_each_assistant_turn_is_an_example_as_inference_renders_it(tokenizer, family):
    import transformers

    from plugins.data.records import Chat, chat_ids

    bos, eos = SPECIAL[family]
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos, eos_token=eos)
    plain, tagged = (TEMPLATES / f"{family}.jinja").read_text(), (TEMPLATES / f"{family}.tagged.jinja").read_text()
    tok = _ours(tokenizer, family, plain)
    chats = {n: c for n, c in CHATS.items() if family == "qwen3" or not n.startswith("tool")}
    for name, chat in chats.items():
        tools = [ADD] if name.startswith("tool") else None
        made = chat_ids(tok, Chat(chat, "a record", tools))
        turns = [k for k, m in enumerate(chat) if m["role"] == "assistant"]
        assert len(made) == len(turns), (family, name)
        as_read = as_template_reads(chat, plain)  # DeepSeek-R1's reads the reasoning in the content
        for (ids, trained), k in zip(made, turns):
            theirs = hf.apply_chat_template(as_read[:k + 1], tools=tools, chat_template=tagged, tokenize=True,
                                            return_dict=True, return_assistant_tokens_mask=True)
            assert ids.tolist() == list(theirs["input_ids"]), (family, name, k)
            assert trained.astype(int).tolist() == _last_run(list(theirs["assistant_masks"])), (family, name, k)
            said = hf.decode([i for i, t in zip(ids, trained) if t])
            reasoning, answer = (s.strip() for s in reasoning_of(chat[k]))
            assert reasoning in said and said.endswith(eos) and answer in said
            if reasoning and not chat[k].get("tool_calls"):  # as at inference: the template's prompt with its generation prompt, then the turn
                prompt = hf.apply_chat_template(as_read[:k], tools=tools, chat_template=plain, tokenize=False,
                                                add_generation_prompt=True)
                assert hf.decode(ids).startswith(prompt + said)  # (then the newline ChatML writes after a turn)
                assert (prompt + said).endswith(written(reasoning, answer) + eos), (family, name, k)
        history = hf.decode(made[-1][0])
        assert all(m["reasoning_content"] not in history for m in chat[:turns[-1]]  # as at inference: dropped
                   if m.get("reasoning_content") and not name.startswith("tool"))

    last = chat_ids(tok, Chat(CHATS["system-two-turns"], "a record"), turns="last")
    each = chat_ids(tok, Chat(CHATS["system-two-turns"], "a record"), turns="each")
    assert len(last) == 1 and [a.tolist() for a in last[0]] == [a.tolist() for a in each[-1]]
    (ids, trained), = chat_ids(tok, Chat(CHATS["reasoning-field"], "a record"), learn_reasoning=False)
    said = hf.decode([i for i, t in zip(ids, trained) if t])
    assert "Two and two" not in said and "Two and two" in hf.decode(ids) and "4." in said and said.endswith(eos)
    from common.problem import InputFault

    with pytest.raises(InputFault, match="a record: the template.*fix: data.chat_turns=each") as refused:
        chat_ids(tok, Chat(CHATS["system-two-turns"], "a record"), turns="all")
    assert ("drops message 3's reasoning" if family == "qwen3" else "the prompt has '<think>") in str(refused.value)


def test_reasoning_a_template_never_reads_is_refused_naming_the_record():
    from plugins.data.records import Chat, render_problem

    qwen25 = (TEMPLATES / "qwen2.5.jinja").read_text()
    why = render_problem(Chat(CHATS["reasoning-field"], "chats.jsonl: line 3"), qwen25)
    assert why.startswith("chats.jsonl: line 3: message 2 has reasoning (reasoning_content)") and "fix:" in why
    assert not render_problem(Chat(CHATS["reasoning-inline"], "x"), qwen25)  # tags in the text are its text
    assert not render_problem(Chat(CHATS["reasoning-field"], "x"), (TEMPLATES / "deepseek-r1.jinja").read_text())


def test_the_tokenize_stage_and_the_preview_count_an_example_per_turn(tokenizer, tmp_path):
    import transformers

    from plugins.data.corpus import tokenized
    from plugins.data.preview import preview
    from tests.conftest import make_cfg

    bos, eos = SPECIAL["qwen3"]
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos, eos_token=eos)
    hf.chat_template = (TEMPLATES / "qwen3.jinja").read_text()
    hf.save_pretrained(tmp_path / "tok")
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": CHATS["system-two-turns"]}) + "\n"
                                                  for _ in range(6)))
    args = ("data=chat", f"data.paths=[{tmp_path}/chats.jsonl]", f"data.tokenizer=hf:{tmp_path}/tok",
            "data.packing=false", "train.seq_len=256", "data.val_fraction=0")
    corpus = tokenized(make_cfg(*args, runs_dir=tmp_path))
    assert len(corpus.train + corpus.val) == 12  # six records, two assistant turns each
    shown = "\n".join(line.plain for line in preview(make_cfg(*args, runs_dir=tmp_path), 1, styled=False))
    assert "example 1 of 2" in shown and "example 2 of 2" in shown and "Grass is green." in shown
