"""Tokenizers (data.tokenizer): `bytes` (one token per byte, then <eos> and <pad>: lossless for any text),
`bpe` (a byte-level BPE of data.vocab_size trained on the corpus's training split with the `tokenizers` library),
or `hf:<folder>` (a Hugging Face tokenizer.json / save_pretrained folder).

Every tokenizer is saved as a `tokenizers` tokenizer.json (the bytes one as a byte-level BPE without merges, whose
ids are the byte values), so the aggregate's hf/ folder carries one `transformers` can load.
"""
from __future__ import annotations

import functools

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from plugins.data.chat import read_template_file, special_texts, templates_of

EOS = 256
PAD = 257
VOCAB_SIZE = 258
EOS_TOKEN, PAD_TOKEN = "<eos>", "<pad>"
HF_PREFIX = "hf:"


def encode(text: bytes) -> np.ndarray:
    return np.frombuffer(text, dtype=np.uint8).astype(np.int64)


def encode_documents(docs: list[bytes]) -> list[np.ndarray]:
    """Each document's bytes followed by <eos>."""
    return [np.append(encode(d), EOS) for d in docs]


def decode(tokens) -> bytes:
    return bytes(int(t) for t in tokens if int(t) < 256)


@dataclass
class Tokenizer:
    kind: str                  # bytes | bpe | hf
    vocab_size: int            # ids are < vocab_size
    eos: int
    pad: int
    backend: object = None     # a tokenizers.Tokenizer (bpe, hf); None: bytes, encoded with numpy
    chat_template: Optional[str] = None   # the Jinja a chat record is rendered with (plugins/data/chat.py)
    special: Optional[dict] = None        # the special tokens' text templates read (bos_token, eos_token, ...)
    bos: tuple = ()                       # the ids its post-processor puts before a text (Llama 3: <|begin_of_text|>)

    @functools.cached_property
    def stops(self) -> tuple[str, ...]:
        """The texts of its special tokens (a turn's stop among them: <|im_end|>, <end_of_turn>, <|eot_id|>, </s>):
        where a template closes the assistant's turn with one, the learned span ends there (plugins/data/chat.py)."""
        return () if self.backend is None else special_texts(self.backend)

    def with_offsets(self):
        """A tokenizers.Tokenizer that gives each token's character offsets (the bytes one: its byte-level twin)."""
        return self.backend if self.backend is not None else _bytes_backend()

    def encode_documents(self, docs: Iterable[bytes]) -> list[np.ndarray]:
        """Each document's tokens followed by <eos>."""
        return [np.append(ids, self.eos) for ids in self.encode(list(docs))]

    def encode(self, texts: list[bytes]) -> list[np.ndarray]:
        """The token ids of each text, nothing else kept (no offsets or strings: encode_batch_fast)."""
        if self.backend is None:
            return [encode(t) for t in texts]
        decoded = [t.decode("utf-8", errors="replace") for t in texts]
        return [np.asarray(e.ids, dtype=np.int64)
                for e in self.backend.encode_batch_fast(decoded, add_special_tokens=False)]

    def save(self, folder: Path) -> None:
        """tokenizer.json and the tokenizer_config.json transformers reads beside it."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        backend = self.backend if self.backend is not None else _bytes_backend()
        backend.save(str(folder / "tokenizer.json"))
        eos, pad = backend.id_to_token(self.eos), backend.id_to_token(self.pad)
        chat = {"chat_template": self.chat_template} if self.chat_template else {}  # kept for transformers' chat
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", **(self.special or {}), "eos_token": eos, "pad_token": pad,
             "model_max_length": 1_000_000, "clean_up_tokenization_spaces": False, **chat}, indent=2) + "\n")
        (folder / "orchestrator_tokenizer.json").write_text(json.dumps(
            {"kind": self.kind, "vocab_size": self.vocab_size, "eos": self.eos, "pad": self.pad,
             "special": self.special, "bos": list(self.bos), **chat}) + "\n")


def _bytes_backend():
    """The bytes tokenizer as a tokenizers byte-level BPE with no merges: token id = byte value, then <eos>, <pad>."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()  # the 256 printable characters byte-level BPE writes bytes as
    by_byte = _byte_to_char()
    assert set(by_byte.values()) == set(alphabet)
    vocab = {by_byte[b]: b for b in range(256)} | {EOS_TOKEN: EOS, PAD_TOKEN: PAD}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([EOS_TOKEN, PAD_TOKEN])
    return backend


def _byte_to_char() -> dict[int, str]:
    """GPT-2's bytes_to_unicode: the printable character that stands for each byte in byte-level BPE."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def train_bpe(train_texts: Iterable[bytes], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of vocab_size tokens (the 256 bytes, <eos>, <pad>, then merges) learned on train_texts,
    streamed (the trainer keeps word counts, not the texts)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN, PAD_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator((d.decode("utf-8", errors="replace") for d in train_texts), trainer=trainer)
    return Tokenizer("bpe", backend.get_vocab_size(), backend.token_to_id(EOS_TOKEN), backend.token_to_id(PAD_TOKEN),
                     backend)


def load_saved(folder: Path) -> Tokenizer:
    """A tokenizer this project saved (Tokenizer.save): the ids it was made with, whatever its kind."""
    from tokenizers import Tokenizer as HFTokenizer

    meta = json.loads((Path(folder) / "orchestrator_tokenizer.json").read_text())
    backend = None if meta["kind"] == "bytes" else HFTokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    return Tokenizer(meta["kind"], meta["vocab_size"], meta["eos"], meta["pad"], backend, meta.get("chat_template"),
                     meta.get("special"), tuple(meta.get("bos") or ()))


def hf_folder(spec: str) -> Optional[Path]:
    return Path(spec[len(HF_PREFIX):]).expanduser() if spec.startswith(HF_PREFIX) else None


AUTO = "auto"  # data.tokenizer's default: the model's own


CARRIED = "tokenizer"  # the folder of a train stage's checkpoint/ that holds the tokenizer its data was made with


def auto_tokenizer(init_from: str) -> str:
    """data.tokenizer=auto: the tokenizer train.init_from ships (the ids its embeddings were trained on): a Hugging
    Face folder's tokenizer.json, or the one a checkpoint of this project carries (its chat template with it, so a
    DPO after an SFT renders as the SFT did); else bytes."""
    if not isinstance(init_from, str) or not init_from:
        return "bytes"
    folder = hf_folder(init_from)
    folder = Path(init_from).expanduser() / CARRIED if folder is None else folder
    return f"{HF_PREFIX}{folder}" if (folder / "tokenizer.json").is_file() else "bytes"


def load_hf(folder: Path) -> Tokenizer:
    """A Hugging Face tokenizer folder (tokenizer.json). <eos> is its eos_token (tokenizer_config.json), else a
    known end-of-text token; padding reuses it when the tokenizer has no pad token (labels there are ignored)."""
    from tokenizers import Tokenizer as HFTokenizer

    folder = Path(folder)
    file = folder / "tokenizer.json" if folder.is_dir() else folder
    try:  # the tokenizers library raises a bare Exception with serde's words ("EOF while parsing a value at ...")
        backend = HFTokenizer.from_file(str(file))
    except Exception as e:
        raise ValueError(f"{file} cannot be parsed as a tokenizer ({e})") from None
    config_path = file.parent / "tokenizer_config.json"
    try:
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    except ValueError as e:
        raise ValueError(f"{config_path} is not JSON ({e})") from None

    def token(name):
        value = config.get(name)
        return value.get("content") if isinstance(value, dict) else value

    candidates = [token("eos_token"), "<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>"]
    eos = next((backend.token_to_id(t) for t in candidates if t and backend.token_to_id(t) is not None), None)
    if eos is None:
        raise ValueError(f"{file}: no end-of-text token (eos_token in tokenizer_config.json, or <|endoftext|>, </s>)")
    pad = backend.token_to_id(token("pad_token")) if token("pad_token") else None
    # ids, not a count: a tokenizer's added tokens may sit past its vocabulary (an id of 100000 in a vocabulary of
    # 50257), and the model's embedding needs a row for the largest id
    ids = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    special = {name: token(name) for name in ("bos_token", "eos_token", "unk_token", "pad_token") if token(name)}
    return Tokenizer("hf", max(backend.get_vocab_size(), ids), eos, eos if pad is None else pad, backend,
                     special=special, bos=added_before(backend))


def added_before(backend) -> tuple:
    """The ids a tokenizer's post-processor puts before a text (what `tokenizer(text)` adds at inference: Llama 3's
    <|begin_of_text|>; GPT-2's: none)."""
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    starts = [i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain]
    return tuple(full[:starts[0]]) if starts else ()


def widest_token(d) -> Optional[int]:
    """The most bytes one token of data.tokenizer covers (its vocabulary's longest, as UTF-8: never less than the
    bytes it stands for); None for a BPE not learned yet, or a tokenizer that cannot be read (said elsewhere)."""
    if d.tokenizer == "bytes":
        return 1
    folder = hf_folder(d.tokenizer)
    if folder is None:
        return None
    from tokenizers import Tokenizer as HFTokenizer

    try:
        vocab = HFTokenizer.from_file(str(folder / "tokenizer.json" if folder.is_dir() else folder)).get_vocab()
    except Exception:  # noqa: BLE001 (the tokenizer rules say what is wrong with it)
        return None
    return max((len(token.encode("utf-8")) for token in vocab), default=None)


def vocab_needed(data_cfg) -> Optional[int]:
    """The vocabulary the model needs for this data config, known before launch (None: adapts to the model)."""
    spec = data_cfg.tokenizer
    if spec == "bytes":
        return VOCAB_SIZE
    if spec == "bpe":
        return data_cfg.vocab_size
    folder = hf_folder(spec)
    return load_hf(folder).vocab_size if folder is not None else None


def make(data_cfg, train_texts: Iterable[bytes] = ()) -> Tokenizer:
    """data.tokenizer: bytes, a BPE learned on train_texts (a sample of the training split), or an HF folder's;
    with data.chat_template, that template (else an HF folder's own)."""
    spec = data_cfg.tokenizer
    if spec == AUTO:  # a bug, not an input: resolve_auto makes it concrete before anything reads the data
        raise ValueError("data.tokenizer=auto reached the tokenizer unresolved (orchestrator/config/resolve.py "
                         "resolves it before planning)")
    if spec == "bytes":
        tok = Tokenizer("bytes", VOCAB_SIZE, EOS, PAD, special={"eos_token": EOS_TOKEN})
    elif spec == "bpe":
        tok = train_bpe(train_texts, data_cfg.vocab_size)
        tok.special = {"eos_token": EOS_TOKEN}
    else:
        tok = load_hf(hf_folder(spec))
    tok.chat_template = chat_template(data_cfg)
    return tok


def template_variables(data_cfg) -> dict:
    """The special tokens' texts a chat template reads (bos_token, eos_token, ...), as the tokenize stage passes them,
    known before launch (a BPE's are the fixed <eos>)."""
    folder = hf_folder(data_cfg.tokenizer)
    if folder is not None:
        return load_hf(folder).special or {}
    return {"eos_token": EOS_TOKEN}


def chat_template(data_cfg) -> Optional[str]:
    """The template chat records are rendered with: data.chat_template (text with Jinja markup is the template,
    anything else a file's path), else the data.tokenizer=hf: folder's own, data.chat_template_name picking one of
    its named templates (None: neither). OSError: the path names no file; ValueError: a file is not UTF-8 (or JSON);
    KeyError: the folder has no template of that name."""
    given = data_cfg.get("chat_template") or ""
    if given:
        if is_template_text(given):
            return given
        return read_template_file(Path(given).expanduser())
    folder = hf_folder(data_cfg.tokenizer)
    if folder is None or not folder.is_dir():
        return None
    name = data_cfg.get("chat_template_name") or ""
    templates = templates_of(folder)
    if name and name not in templates:
        raise KeyError(name)
    return templates.get(name or "default")


def is_template_text(value: str) -> bool:
    """data.chat_template is the template's text when it has Jinja markup; else it is a path."""
    return "{{" in value or "{%" in value
