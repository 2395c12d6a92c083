"""A tiny Llama and its ChatML tokenizer in a Hugging Face folder, made here with transformers (no Hub), and a file
of chats to fine-tune it on: the offline way into the fine-tuning walk-through (docs/models-and-data.md, "Offline").

    python scripts/tiny_chat_model.py tiny-llama --chats chats.jsonl [--pairs pairs.jsonl] [--records 600] [--seed 0]

The folder is what `save_pretrained` writes for a chat model: config.json and model.safetensors (random weights of
the shape of `model=llama_tiny`), tokenizer.json (a byte-level BPE of 320 tokens learned from the chats, with
<|im_start|>, <|im_end|> and <|endoftext|>), tokenizer_config.json and chat_template.jinja: ChatML as models ship
it, without generation tags (the project finds the assistant's turns by rendering). The chats are arithmetic
questions and answers, some with a system message; the preference pairs (for objective=dpo) the same questions with
the right sum chosen and a near miss rejected.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

CHATML = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
          "{%- endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=192, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)


def chats(records: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    out = []
    for _ in range(records):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        chat = [{"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": f"{a + b}."}]
        if rng.random() < 0.3:
            chat.insert(0, {"role": "system", "content": "Answer with the number."})
        out.append(chat)
    return out


def preference_pairs(records: int, seed: int) -> list[dict]:
    """Arithmetic questions with the right sum chosen and a near miss rejected (TRL's conversational form)."""
    rng = random.Random(seed)
    out = []
    for _ in range(records):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        wrong = a + b + rng.choice([-10, -1, 1, 10])
        out.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
                    "chosen": [{"role": "assistant", "content": f"{a + b}."}],
                    "rejected": [{"role": "assistant", "content": f"{wrong}."}]})
    return out


def make(folder: Path, conversations: list[list[dict]], seed: int = 0) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [m["content"] for chat in conversations for m in chat] + ["user", "assistant", "system"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=LLAMA_TINY["vocab_size"], special_tokens=SPECIAL,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = CHATML
    torch.manual_seed(seed)
    eos, pad = hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_TINY, bos_token_id=None, eos_token_id=eos,
                                                                   pad_token_id=pad))
    model.save_pretrained(folder)
    hf.save_pretrained(folder)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="the Hugging Face folder to write")
    parser.add_argument("--chats", type=Path, help="also write this many chats as JSON Lines (--records)")
    parser.add_argument("--pairs", type=Path, help="also write this many preference pairs as JSON Lines (--records)")
    parser.add_argument("--records", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    conversations = chats(args.records, args.seed)
    make(args.folder, conversations, args.seed)
    print(f"wrote {args.folder}: a Llama of the shape of model=llama_tiny, its ChatML tokenizer and template")
    if args.chats:
        args.chats.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
        print(f"wrote {args.chats}: {len(conversations)} chats")
    if args.pairs:
        made = preference_pairs(args.records, args.seed + 1)  # other questions than the chats'
        args.pairs.write_text("".join(json.dumps(p) + "\n" for p in made))
        print(f"wrote {args.pairs}: {len(made)} preference pairs (the right sum chosen, a near miss rejected)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
