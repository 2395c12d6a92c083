"""Chat records rendered as transformers' apply_chat_template renders them (plugins/data/chat.py): the same token
ids, and the same assistant mask (return_assistant_tokens_mask) from a template with `generation` tags."""
from __future__ import annotations

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
    ({"messages": [{"role": "user", "text": "hi"}]}, "is not a list of {role, content} messages"),
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
