"""What finding the assistant's turns by rendering costs: chat records tokenized per second with a template's
generation tags (one rendering, transformers' way) against the same template without them (the project's prefix
renderings: two or three more for the first assistant turn, none for a later turn written as the first), for
conversations of 1 to N turns, alternating in one process.

    python benchmarks/chat_masks.py [records=300] [rounds=3] [turns=1,4,10] [families=qwen2.5,llama3]

The templates are tests/data/chat_templates' (as the models ship them, and our tagged copies); the tokenizer is a
byte-level BPE with the families' special tokens, as the tests use.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.support.cli import arguments  # noqa: E402

from plugins.data.chat import encode_chat  # noqa: E402

TEMPLATES = ROOT / "tests" / "data" / "chat_templates"
SPECIAL = {"llama3": ("<|begin_of_text|>", "<|eot_id|>"), "qwen2.5": ("<|endoftext|>", "<|im_end|>"),
           "mistral": ("<s>", "</s>"), "gemma": ("<bos>", "<eos>"), "phi3": ("<s>", "<|endoftext|>")}


def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = sorted({t for pair in SPECIAL.values() for t in pair} | {
        "<|start_header_id|>", "<|end_header_id|>", "<|im_start|>", "<start_of_turn>", "<end_of_turn>", "<|user|>",
        "<|assistant|>", "<|system|>", "<|end|>"})
    tok.train_from_iterator([f"What is {a} plus {a + 1}? It is {2 * a + 1}." for a in range(500)],
                            trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def chat(turns: int, seed: int) -> list[dict]:
    messages = []
    for t in range(turns):
        a = seed * 31 + t
        messages += [{"role": "user", "content": f"What is {a} plus {a + 1}? Answer in a sentence."},
                     {"role": "assistant", "content": f"It is {2 * a + 1}, the sum of {a} and {a + 1}."}]
    return messages


def rate(tok, template: str, chats: list, variables: dict) -> float:
    t0 = time.perf_counter()
    for messages in chats:
        encode_chat(tok, template, messages, **variables)
    return len(chats) / (time.perf_counter() - t0)


def main(argv: list[str]) -> int:
    args = arguments(argv, __doc__)
    records, rounds = int(args.get("records", 300)), int(args.get("rounds", 3))
    turn_counts = [int(t) for t in str(args.get("turns", "1,4,10")).split(",")]
    families = str(args.get("families", "qwen2.5,llama3")).split(",")
    tok = tokenizer()
    print(f"{records} chats per round, {rounds} alternating rounds; records/s (median)")
    print(f"{'template':10} {'turns':>5} {'tagged':>10} {'untagged':>10} {'untagged/tagged':>16}")
    for family in families:
        plain = (TEMPLATES / f"{family}.jinja").read_text()
        tagged = (TEMPLATES / f"{family}.tagged.jinja").read_text()
        bos, eos = SPECIAL[family]
        variables = {"bos_token": bos, "eos_token": eos}
        for turns in turn_counts:
            chats = [chat(turns, i) for i in range(records)]
            rate(tok, plain, chats[:10], variables), rate(tok, tagged, chats[:10], variables)  # compile, warm up
            sides = {"tagged": [], "untagged": []}
            for _ in range(rounds):
                sides["tagged"].append(rate(tok, tagged, chats, variables))
                sides["untagged"].append(rate(tok, plain, chats, variables))
            t, u = statistics.median(sides["tagged"]), statistics.median(sides["untagged"])
            print(f"{family:10} {turns:>5} {t:>10,.0f} {u:>10,.0f} {u / t:>16.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
