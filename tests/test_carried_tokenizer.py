"""A train stage's checkpoint/ carries the tokenizer its data was made with (stages/train.py), so data.tokenizer=auto
from it reads the same ids and the same chat template: a DPO after an SFT renders its pairs as the SFT rendered its
chats, with no tokenizer or template named again (tests/test_dpo.py checks a real checkpoint carries it)."""
from __future__ import annotations

import numpy as np

from orchestrator.config.resolve import resolve_auto
from plugins.data.tokenizer import CARRIED, EOS, PAD, VOCAB_SIZE, Tokenizer, encode, make
from tests.conftest import make_cfg

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_auto_from_a_checkpoint_is_the_tokenizer_it_carries(tmp_path):
    checkpoint = tmp_path / "checkpoint"  # as the train stage writes it: the manifest's files, and the tokenizer
    Tokenizer("bytes", VOCAB_SIZE, EOS, PAD, chat_template=CHATML, special={"eos_token": "<eos>"}).save(
        checkpoint / CARRIED)
    cfg = make_cfg(f"train.init_from={checkpoint}")
    resolve_auto(cfg)
    assert cfg.data.tokenizer == f"hf:{checkpoint / CARRIED}"
    tok = make(cfg.data)
    assert tok.chat_template == CHATML and (tok.eos, tok.pad, tok.vocab_size) == (EOS, PAD, VOCAB_SIZE)
    text = "a chat, é".encode()
    assert np.array_equal(tok.encode([text])[0], encode(text))  # the ids the checkpoint was trained on


def test_auto_from_a_checkpoint_without_one_is_bytes(tmp_path):
    cfg = make_cfg(f"train.init_from={tmp_path}")  # written before checkpoints carried their tokenizer
    resolve_auto(cfg)
    assert cfg.data.tokenizer == "bytes"
