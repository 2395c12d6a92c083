"""Chat records rendered as transformers' apply_chat_template renders them (plugins/data/chat.py): the same token
ids, and the same assistant mask (return_assistant_tokens_mask) from a template with `generation` tags."""
from __future__ import annotations

from pathlib import Path

import pytest

from plugins.data.chat import encode_chat, template_of

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
          "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
          "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHATS = [
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4."}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue, like the sea."},
     {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Green — grass."}],
]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [m["content"] for chat in CHATS for m in chat] * 20
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>")
    hf.chat_template = CHATML
    folder = tmp_path_factory.mktemp("tokenizer")
    hf.save_pretrained(folder)
    return hf, folder


@pytest.mark.parametrize("chat", CHATS, ids=["one-turn", "two-turns"])
def test_ids_and_assistant_mask_equal_apply_chat_template(hf_tokenizer, chat):
    hf, folder = hf_tokenizer
    theirs = hf.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    template = template_of(folder)
    assert template == CHATML  # read from the folder save_pretrained wrote
    ids, trained = encode_chat(hf.backend_tokenizer, template, chat, bos_token=hf.bos_token, eos_token=hf.eos_token)
    assert ids.tolist() == list(theirs["input_ids"])
    assert trained.astype(int).tolist() == list(theirs["assistant_masks"])
    assert 0 < trained.sum() < len(ids)  # the answers, not the prompts
    said = hf.decode([i for i, t in zip(ids, trained) if t])
    assert all(m["content"] in said for m in chat if m["role"] == "assistant")


STRICT = CHATML.replace("{% for message in messages %}", "{% for message in messages %}{% if message['role'] == "
                        "'system' and not loop.first %}{{ raise_exception('the system message must come first') }}"
                        "{% endif %}")


@pytest.mark.parametrize("bad,words", [
    ({"messages": [{"role": "human", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
     "role 'human' is neither one of system, user, assistant, tool nor named by the chat template"),
    ({"messages": [{"role": "user", "text": "hi"}]}, "message 1 has no 'content' (its fields: role, text)"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"},
                   {"role": "assistant", "content": "ok"}]}, "the system message must come first"),
], ids=["unknown-role", "not-messages", "fails-to-render"])
def test_a_bad_chat_record_is_refused_naming_its_file_and_line(tmp_path, hf_tokenizer, bad, words):
    import json

    from plugins.data.corpus import tokenized
    from tests.conftest import make_cfg

    _, folder = hf_tokenizer
    lines = [json.dumps({"messages": chat}) for chat in CHATS * 3]
    lines.insert(4, json.dumps(bad))
    (tmp_path / "chats.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "strict.jinja").write_text(STRICT)
    cfg = make_cfg("data=text", f"data.paths=[{tmp_path}/chats.jsonl]", "data.format=chat",
                   f"data.tokenizer=hf:{folder}", f"data.chat_template={tmp_path}/strict.jinja", "data.packing=false",
                   "train.seq_len=32", "train.batch_size=2", runs_dir=tmp_path)
    with pytest.raises(ValueError) as e:
        tokenized(cfg)
    assert f"{tmp_path}/chats.jsonl: line 5" in str(e.value) and words in str(e.value)


# -- the templates models ship, without generation tags (tests/data/chat_templates) -----------------------------

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
SPECIAL = {"llama3": ("<|begin_of_text|>", "<|eot_id|>"), "llama3.1": ("<|begin_of_text|>", "<|eot_id|>"),
           "qwen2.5": ("<|endoftext|>", "<|im_end|>"),
           "mistral": ("<s>", "</s>"), "mistral-nemo": ("<s>", "</s>"), "gemma": ("<bos>", "<eos>"),
           "gemma3": ("<bos>", "<eos>"),
           "phi3": ("<s>", "<|endoftext|>"), "phi4-mini": ("<|endoftext|>", "<|endoftext|>")}
TURNS = ["<|start_header_id|>", "<|end_header_id|>", "<|im_start|>", "<start_of_turn>", "<end_of_turn>", "<|user|>",
         "<|assistant|>", "<|system|>", "<|end|>"]
SYSTEM = {"role": "system", "content": "You are terse."}
CONVERSATIONS = {
    "one-turn": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}],
    "two-turns": CHATS[1],
    "ends-with-user": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                       {"role": "user", "content": "Bye"}],
    "spaces-and-unicode": [{"role": "user", "content": "  Über café?\n"},
                           {"role": "assistant", "content": "\nJa — naïve 🙂 \n\n"}],
    "four-turns": [m for i in range(4) for m in ({"role": "user", "content": f"Is {i} odd?"},
                                                  {"role": "assistant", "content": f"{'Yes' if i % 2 else 'No'}."})],
}


@pytest.fixture(scope="module")
def family_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = sorted({t for pair in SPECIAL.values() for t in pair} | set(TURNS))
    texts = [m["content"] for chat in CONVERSATIONS.values() for m in chat] * 20
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _supports_system(family: str) -> bool:
    return family in ("llama3", "llama3.1", "qwen2.5", "phi3", "phi4-mini", "gemma3")  # Gemma 3's: in the first turn


def _opens_with_assistant(family: str) -> bool:
    return family in ("llama3", "llama3.1", "qwen2.5", "phi3", "phi4-mini")  # the others: a user's turn first


@pytest.mark.parametrize("family", sorted(SPECIAL))
def test_masks_from_a_template_without_tags_equal_what_tags_mark(family_tokenizer, family):
    """Llama 3 and 3.1, Qwen 2.5, Mistral, Gemma (1 and 3), Phi-3 and Phi-4-mini as they ship: what the assistant
    said is found by rendering the conversation prefix by prefix; the ids and masks equal apply_chat_template's with
    generation tags added to a copy of the template (return_assistant_tokens_mask) as TRL's training templates place
    them: the answer and the token that closes its turn (<|im_end|>, <end_of_turn>, <|end|>), never the newline after
    it, nor an <eos> after it (Phi-4-mini's template ends the whole chat with one)."""
    import transformers

    from plugins.data.records import Chat, chat_ids
    from plugins.data.tokenizer import Tokenizer

    bos, eos = SPECIAL[family]
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=family_tokenizer, bos_token=bos, eos_token=eos)
    plain, tagged = (TEMPLATES / f"{family}.jinja").read_text(), (TEMPLATES / f"{family}.tagged.jinja").read_text()
    chats = dict(CONVERSATIONS)
    if _supports_system(family):
        chats["system"] = [SYSTEM] + CONVERSATIONS["two-turns"]
    if _opens_with_assistant(family):
        chats["opens-with-assistant"] = [{"role": "assistant", "content": "Hello! How can I help?"},
                                         *CONVERSATIONS["one-turn"]]
    for name, chat in chats.items():
        theirs = hf.apply_chat_template(chat, chat_template=tagged, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
        ids, trained = encode_chat(family_tokenizer, plain, chat, bos_token=bos, eos_token=eos)
        assert ids.tolist() == list(theirs["input_ids"]), (family, name)
        assert trained.astype(int).tolist() == list(theirs["assistant_masks"]), (family, name)
        tok = Tokenizer("hf", 400, family_tokenizer.token_to_id(eos), family_tokenizer.token_to_id(eos),
                        family_tokenizer, plain, {"bos_token": bos, "eos_token": eos})
        (staged,) = chat_ids(tok, Chat(chat, "a record"))  # as the tokenize stage: no <eos> after the turn's own stop
        assert [a.tolist() for a in staged] == [ids.tolist(), trained.tolist()], (family, name)
        said = hf.decode([i for i, t in zip(ids, trained) if t])
        assert all(m["content"].strip() in said for m in chat if m["role"] == "assistant"), (family, name, said)
        assert not any(m["content"] in said for m in chat if m["role"] != "assistant"), (family, name, said)


def test_a_system_prompt_moved_into_the_last_user_turn_trains_an_example_per_turn_as_at_inference(family_tokenizer):
    """Mistral-Nemo's template writes the system prompt into the last user turn, and only while that turn ends the
    conversation: rendered whole, a chat loses it. data.chat_turns=auto (and each) makes an example per assistant
    turn, each transformers' apply_chat_template of the conversation before the turn with its generation prompt (the
    system prompt in the last user turn, as at inference), then the turn as the template writes it (its text and
    </s>), which alone is learned; all (one example) is refused, naming the fix."""
    import transformers

    from common.problem import InputFault
    from plugins.data.records import Chat, chat_ids
    from plugins.data.tokenizer import Tokenizer

    bos, eos = SPECIAL["mistral-nemo"]
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=family_tokenizer, bos_token=bos, eos_token=eos)
    plain = (TEMPLATES / "mistral-nemo.jinja").read_text()
    tok = Tokenizer("hf", 400, family_tokenizer.token_to_id(eos), family_tokenizer.token_to_id(eos),
                    family_tokenizer, plain, {"bos_token": bos, "eos_token": eos})
    for name in ("one-turn", "four-turns"):
        chat = [SYSTEM] + CONVERSATIONS[name]
        turns = [k for k, m in enumerate(chat) if m["role"] == "assistant"]
        for turn_mode in ("auto", "each"):
            made = chat_ids(tok, Chat(chat, "a record"), turns=turn_mode)
            assert len(made) == len(turns), (name, turn_mode)
            for (ids, trained), k in zip(made, turns):
                prompt = hf.apply_chat_template(chat[:k], chat_template=plain, tokenize=False,
                                                add_generation_prompt=True)
                assert SYSTEM["content"] + "\n\n" + chat[k - 1]["content"] + "[/INST]" in prompt
                theirs = hf(prompt + chat[k]["content"] + eos, add_special_tokens=False, return_offsets_mapping=True)
                assert ids.tolist() == theirs["input_ids"], (name, k)
                assert trained.tolist() == [a >= len(prompt) for a, _ in theirs["offset_mapping"]], (name, k)
    with pytest.raises(InputFault, match="fix: data.chat_turns=each"):
        chat_ids(tok, Chat([SYSTEM] + CONVERSATIONS["one-turn"], "a record"), turns="all")


@pytest.mark.parametrize("family", sorted(SPECIAL))
def test_later_turns_found_in_one_rendering_are_where_their_own_prefix_renderings_put_them(family):
    """A long chat's turns after the first are found in the one rendering where it writes them as the first
    (spans_like_first): the spans its own prefix renderings give (turn_span), for every family; it takes them where
    a template writes a turn otherwise (one that marks the second-to-last question: the renderings do not extend)."""
    from plugins.data.chat import NotExtending, assistant_spans, prefix_spans, render, spans_like_first, turn_span

    bos, eos = SPECIAL[family]
    plain, v = (TEMPLATES / f"{family}.jinja").read_text(), {"bos_token": bos, "eos_token": eos}
    chats = [CONVERSATIONS["four-turns"]] + ([[SYSTEM] + CONVERSATIONS["four-turns"]] if _supports_system(family)
                                             else [])
    for chat in chats:
        text, assistant = render(plain, chat, **v)[0], [k for k, m in enumerate(chat) if m["role"] == "assistant"]
        own = [turn_span(plain, chat, k, text, (eos, *TURNS), **v) for k in assistant]
        assert spans_like_first(chat, text, assistant, own[0], **v) == own[1:], (family, chat[0])
        assert prefix_spans(plain, chat, text, (eos, *TURNS), **v) == own
    marks = ("{% for m in messages %}{% if loop.index0 == messages|length - 4 %}<mark>{% endif %}{{ m['role'] }}: "
             "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    chat = CONVERSATIONS["four-turns"][:6]
    text = render(marks, chat)[0]
    assert spans_like_first(chat, text, [1, 3, 5], turn_span(marks, chat, 1, text)) is None
    with pytest.raises(NotExtending, match="is not the start of the whole"):
        assistant_spans(marks, chat)


def test_a_template_whose_renderings_do_not_extend_each_other_is_refused():
    from plugins.data.chat import NotExtending, assistant_spans

    # the last assistant turn rendered otherwise than the earlier ones (as templates that drop earlier reasoning do)
    odd = ("{% for m in messages %}{% if loop.last and m['role'] == 'assistant' %}<final>{% endif %}"
           "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(NotExtending, match="what the assistant said cannot be told apart"):
        assistant_spans(odd, CONVERSATIONS["one-turn"])


@pytest.mark.parametrize("cluster", ["local", "debug"])
def test_a_bad_record_past_the_checked_ones_fails_the_stage_in_one_clean_message(tmp_path, cluster):
    """Line 41 (the checks before launch render a file's first records; past them they read their fields alone): the
    tokenize stage fails naming the file, the line and the fix (data.bad_records=skip among them), exit status 1, no
    Python traceback (a rank's, or the debug cluster's in-process one)."""
    import json

    from plugins.data.records import CHECKED_RECORDS
    from tests.conftest import run_cli

    rows = [[{"role": "user", "content": f"What is {a}+1?"}, {"role": "assistant", "content": f"{a + 1}."}]
            for a in range(80)]
    rows[40][0]["role"] = "human"  # a role the template does not name: a fault of the rendering
    assert 40 > CHECKED_RECORDS
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    done = run_cli(["data=chat", "data.paths=[chats.jsonl]", f"data.chat_template={TEMPLATES}/qwen2.5.jinja",
                    "train.steps=2", "train.eval_batches=1", "tracking=none", f"cluster={cluster}"], tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 1 and "Traceback" not in out, out[-4000:]
    assert "chats.jsonl: line 41: a message's role 'human' is neither one of" in out and \
        "or data.bad_records=skip (each bad record left out and counted)" in out


ADD = {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}
CALLING = [{"role": "user", "content": "Add 2 and 3."},
           {"role": "assistant", "content": "", "tool_calls": [
               {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
           {"role": "tool", "content": "5"}, {"role": "assistant", "content": "2 + 3 = 5."}]


def test_tools_and_tool_calls_reach_the_template_as_transformers_passes_them(family_tokenizer, tmp_path):
    """A record's `tools` (data.tools_field) render Qwen 2.5's and Llama 3.1's tools blocks; its tool calls are
    learned through the stop token, the tool's response is not: ids and masks equal apply_chat_template(tools=...) on
    the tagged copy. The tokenize stage reads such records (Llama 3.1's); a template that never reads tools refuses
    the record, naming it."""
    import transformers

    from plugins.data.records import Chat, chat_ids, render_problem
    from plugins.data.tokenizer import Tokenizer

    families = (("qwen2.5", "# Tools", '<tool_call>\n{"name": "add"', "<tool_response>"),
                ("llama3.1", "Given the following functions", '{"name": "add", "parameters": {"a": 2',
                 "<|start_header_id|>ipython"))  # what renders the tools, a learned call, the tool's unlearned answer
    for family, tools_said, call_said, response in families:
        bos, eos = SPECIAL[family]
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=family_tokenizer, bos_token=bos, eos_token=eos)
        plain, tagged = (TEMPLATES / f"{family}.jinja").read_text(), (TEMPLATES / f"{family}.tagged.jinja").read_text()
        tok = Tokenizer("hf", 400, family_tokenizer.token_to_id(eos), family_tokenizer.token_to_id(eos),
                        family_tokenizer, plain, {"bos_token": bos, "eos_token": eos})
        for chat in (CONVERSATIONS["one-turn"], CALLING):
            theirs = hf.apply_chat_template(chat, tools=[ADD], chat_template=tagged, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
            ((ids, trained),) = chat_ids(tok, Chat(chat, "a record", [ADD]))
            assert ids.tolist() == list(theirs["input_ids"]) and tools_said in hf.decode(ids), family
            assert trained.astype(int).tolist() == list(theirs["assistant_masks"]), family
        said = hf.decode([i for i, t in zip(ids, trained) if t])
        assert call_said in said and response not in said and "2 + 3 = 5." in said, (family, said)
    import json

    from plugins.data.corpus import tokenized
    from tests.conftest import make_cfg

    hf.chat_template = plain
    hf.save_pretrained(tmp_path / "tok")  # the same records read from JSON Lines by the tokenize stage
    (tmp_path / "calls.jsonl").write_text("".join(json.dumps({"messages": CALLING, **({"tools": [ADD]} if i % 2 else
                                                                                        {})}) + "\n" for i in range(8)))
    corpus = tokenized(make_cfg("data=chat", f"data.paths=[{tmp_path}/calls.jsonl]",
                                f"data.tokenizer=hf:{tmp_path}/tok", "data.packing=false", "train.seq_len=512",
                                runs_dir=tmp_path))
    assert {len(d) for d in corpus.train + corpus.val} == {len(ids), len(chat_ids(tok, Chat(CALLING, "x"))[0][0])}
    llama = (TEMPLATES / "llama3.jinja").read_text()  # Llama 3's first template has no tools
    assert "never reads tools" in render_problem(Chat(CONVERSATIONS["one-turn"], "a record", [ADD]), llama)
