"""Hugging Face interop: a `save_pretrained` folder of a GPT-2 or Llama model in, a folder `transformers` loads out.

Only files are read and written (config.json, safetensors, sharded as save_pretrained shards them), so importing
needs neither `transformers` nor a network; the tests check both directions against `transformers` itself. Both
directions go one tensor at a time: a rank imports only what it holds, and an export holds one shard. Names map one to one, except GPT-2's
Conv1D layers, which store (in, out) where a Linear stores (out, in), and its fused q/k/v projection `c_attn`.
Llama's q/k projections are stored by Hugging Face in the layout its rotate-half RoPE expects, which is ours; Llama
3.1's rope_scaling (rope_type llama3) is model.rope_scaling=llama3 with its four numbers; other scalings are refused.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional, Union

import torch

from storage import safetensors_shards as shards
from storage.fsio import KnownHashes, atomic_write_json
from storage.safetensors_shards import Reader

PREFIX = "hf:"
DEFAULT_SHARD_BYTES = 5 * 10**9  # save_pretrained's max_shard_size="5GB"
ARCHITECTURES = {"GPT2LMHeadModel": "gpt", "LlamaForCausalLM": "llama"}
GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu",
                    "silu": "silu"}


class HFError(ValueError):
    """A folder this interop cannot read; the message says what and why."""


def folder_of(init_from: Optional[str]) -> Optional[Path]:
    """The folder of `train.init_from=hf:<folder>` (None for any other value)."""
    return Path(init_from[len(PREFIX):]).expanduser() if init_from and init_from.startswith(PREFIX) else None


def stamps(folder: Path) -> str:
    """A digest of the folder's files as they are now (names, sizes, modification times): what a run keyed on it, or
    adapters trained on it, saw; a stat per file, no read."""
    return hashlib.sha256(json.dumps(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                                            for p in folder.iterdir() if p.is_file())).encode()).hexdigest()


def read_config(folder: Path) -> tuple[str, dict]:
    """(our model family, our model.* values) of a Hugging Face folder."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise HFError(f"{folder} holds no config.json: not a save_pretrained folder")
    c = json.loads(path.read_text())
    archs = c.get("architectures") or [c.get("model_type", "?")]
    family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if family is None:
        raise HFError(f"architecture {', '.join(archs)} is not supported: the supported ones are "
                      f"{', '.join(ARCHITECTURES)}")
    if family == "gpt":
        for field, plain in (("scale_attn_by_inverse_layer_idx", False), ("reorder_and_upcast_attn", False),
                             ("scale_attn_weights", True)):
            if c.get(field, plain) != plain:  # attention computed otherwise: the model would not be the same one
                raise HFError(f"GPT-2 with {field}={str(c[field]).lower()} is not supported (its attention is "
                              f"computed otherwise; only {field}={str(plain).lower()})")
        act = c.get("activation_function", "gelu_new")
        if act not in GPT2_ACTIVATIONS:
            raise HFError(f"GPT-2 activation_function={act} is not supported ({', '.join(GPT2_ACTIVATIONS)})")
        return family, {"name": "gpt", "vocab_size": c["vocab_size"], "n_layers": c["n_layer"], "n_heads": c["n_head"],
                        "d_model": c["n_embd"], "d_ff": c.get("n_inner") or 4 * c["n_embd"],
                        "max_seq_len": c["n_positions"], "activation": GPT2_ACTIVATIONS[act], "bias": True,
                        "tie_embeddings": c.get("tie_word_embeddings", True)}
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise HFError(f"rope scaling {kind!r} is not supported (the default rotary embedding, and llama3's)")
    if c.get("attention_bias") or c.get("mlp_bias"):
        raise HFError("Llama with attention_bias or mlp_bias is not supported")
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    if head_dim * c["num_attention_heads"] != c["hidden_size"]:
        raise HFError(f"head_dim={head_dim} x num_attention_heads != hidden_size: not supported")
    return family, {"name": "llama", "vocab_size": c["vocab_size"], "n_layers": c["num_hidden_layers"],
                    "n_heads": c["num_attention_heads"], "n_kv_heads": c.get("num_key_value_heads"),
                    "d_model": c["hidden_size"], "d_ff": c["intermediate_size"],
                    "max_seq_len": c["max_position_embeddings"], "norm_eps": c.get("rms_norm_eps", 1e-6),
                    "rope_theta": float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
                    "tie_embeddings": c.get("tie_word_embeddings", False), "bias": False,
                    "rope_scaling": "none" if kind == "default" else kind,
                    **(_llama3_rope(rope, c["max_position_embeddings"]) if kind == "llama3" else {})}


# model.rope_* of llama3 scaling -> (its name in Hugging Face's rope_scaling / rope_parameters, its type)
LLAMA3_ROPE = {"rope_factor": ("factor", float), "rope_low_freq_factor": ("low_freq_factor", float),
               "rope_high_freq_factor": ("high_freq_factor", float),
               "rope_original_max_seq_len": ("original_max_position_embeddings", int)}


def _llama3_rope(rope: dict, positions: int) -> dict:
    """Our model.rope_* of a llama3 rope_scaling (the original context defaults to the model's, as in transformers)."""
    missing = [theirs for theirs in ("factor", "low_freq_factor", "high_freq_factor") if theirs not in rope]
    if missing:
        raise HFError(f"rope scaling 'llama3' without {', '.join(missing)}: the frequencies are not defined")
    return {k: cast(rope.get(theirs, positions)) for k, (theirs, cast) in LLAMA3_ROPE.items()}


def differences(model_cfg, folder: Path) -> dict[str, tuple]:
    """model.* keys whose value differs from the folder's config: key -> (ours, theirs)."""
    _, theirs = read_config(folder)
    return {k: (model_cfg.get(k), v) for k, v in theirs.items()
            if model_cfg.get(k) != v and not (k == "n_kv_heads" and v in (None, model_cfg.get("n_heads")) and
                                              model_cfg.get(k) in (None, model_cfg.get("n_heads")))}


VOCAB_ROWS = ("wte.weight", "lm_head.weight")  # the parameters model.pad_vocab_to pads
GPT2_CONV = {"attn.c_proj": "attn.wo", "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}  # stored (in, out)
GPT2_NORMS = {"ln_1": "ln1", "ln_2": "ln2"}
GPT2_TOP = ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias", "lm_head.weight")
LLAMA_NAMES = {"self_attn.q_proj": "attn.wq", "self_attn.k_proj": "attn.wk", "self_attn.v_proj": "attn.wv",
               "self_attn.o_proj": "attn.wo", "mlp.gate_proj": "mlp.fc1", "mlp.up_proj": "mlp.fc3",
               "mlp.down_proj": "mlp.fc2", "input_layernorm": "ln1", "post_attention_layernorm": "ln2"}
LLAMA_TOP = {"embed_tokens.weight": "wte.weight", "norm.weight": "ln_f.weight", "lm_head.weight": "lm_head.weight"}


class Weights(Mapping[str, torch.Tensor]):
    """A folder's weights under our parameter names, each read from the files when asked for (fp32): a rank that
    holds a shard of a layer reads that layer's tensors, never the whole model. GPT-2's Conv1D weights come as
    transposed views, not copies: copied into a parameter they are copied once, and the ONNX model, which stores a
    Linear's weight transposed, takes the bytes as they were read."""

    def __init__(self, recipes: dict[str, Callable[[], torch.Tensor]]):
        self._recipes = recipes

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._recipes[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._recipes)

    def __len__(self) -> int:
        return len(self._recipes)


def _reader(folder: Path) -> Reader:
    """save_pretrained's model.safetensors or its sharded set; else whatever *.safetensors the folder holds."""
    try:
        return Reader(folder, "model" if shards.exists(folder, "model") else None)
    except FileNotFoundError:
        raise HFError(f"{folder} holds no *.safetensors weights (save with safe_serialization=True)") from None


def load_state(folder: Path, vocab_rows: Optional[int] = None,
               padding: Optional[Mapping[str, torch.Tensor]] = None) -> Weights:
    """The folder's weights under our parameter names (fp32), read lazily; with vocab_rows, the embedding and head
    padded to that many rows (model.pad_vocab_to: the padding's logits never count): padding's rows where it holds
    them (the aggregate's vocab_padding.safetensors: the rows the checkpoint had), else zeros."""
    family, cfg = read_config(folder)
    reader = _reader(folder)
    names = {re.sub(r"^(transformer|model)\.", "", k): k for k in reader}
    last: dict[str, torch.Tensor] = {}  # the fused q/k/v tensor read for q, kept for k and v (until another read)

    def get(short: str) -> torch.Tensor:
        if short in last:
            return last[short]
        last.clear()
        t = reader[names[short]].float()
        if "c_attn" in short:
            last[short] = t
        return t

    recipes: dict[str, Callable[[], torch.Tensor]] = {}
    if family == "gpt":
        d = cfg["d_model"]
        for short in names:
            m = re.match(r"h\.(\d+)\.(.+)$", short)
            if not m:
                if short in GPT2_TOP:
                    recipes[short] = partial(get, short)
                continue
            i, rest = m.groups()
            pre = f"layers.{i}."
            module, leaf = rest.rsplit(".", 1)
            if module == "attn.c_attn":  # fused q/k/v, stored (in, 3 * out)
                for j, x in enumerate("qkv"):
                    recipes[pre + f"attn.w{x}.{leaf}"] = partial(_fused_part, get, short, leaf == "weight", d, j)
            elif module in GPT2_CONV:
                recipes[pre + f"{GPT2_CONV[module]}.{leaf}"] = partial(_conv, get, short, leaf == "weight")
            elif module in GPT2_NORMS:
                recipes[pre + f"{GPT2_NORMS[module]}.{leaf}"] = partial(get, short)
    else:
        for short in names:
            m = re.match(r"layers\.(\d+)\.(.+)\.weight$", short)
            if m and m.group(2) in LLAMA_NAMES:
                recipes[f"layers.{m.group(1)}.{LLAMA_NAMES[m.group(2)]}.weight"] = partial(get, short)
            elif short in LLAMA_TOP:
                recipes[LLAMA_TOP[short]] = partial(get, short)
    if cfg["tie_embeddings"]:
        recipes.pop("lm_head.weight", None)
    for k in VOCAB_ROWS:
        if vocab_rows and k in recipes:
            recipes[k] = partial(_padded, recipes[k], vocab_rows, partial(padding.__getitem__, k)
                                 if padding is not None and k in padding else None)
    return Weights(recipes)


def _fused_part(get, short: str, weight: bool, d: int, j: int) -> torch.Tensor:
    fused = get(short)
    return (fused.t() if weight else fused).split(d, dim=0)[j].clone()  # not a view of the tensor kept


def _conv(get, short: str, weight: bool) -> torch.Tensor:
    return get(short).t() if weight else get(short)


def _padded(make: Callable[[], torch.Tensor], rows: int,
            extra: Optional[Callable[[], torch.Tensor]]) -> torch.Tensor:
    t = make()
    if t.shape[0] >= rows:
        return t
    pad = extra() if extra is not None else t.new_zeros(rows - t.shape[0], t.shape[1])
    return torch.cat([t, pad.to(t.dtype)])


@dataclass(frozen=True)
class Recipe:
    """One Hugging Face tensor: the tensors of ours it is made of, and how (a transpose, a concatenation, a cut)."""
    sources: tuple[str, ...]
    make: Callable[[list[torch.Tensor]], torch.Tensor]


def folder_plan(model_cfg, ours: Mapping[str, object]) -> Union[str, tuple[dict[str, Recipe], dict]]:
    """How our weights (names in `ours`) become a save_pretrained folder: ({their name: Recipe}, config.json), or why
    the model cannot be expressed as one."""
    d, n = model_cfg.d_model, model_cfg.n_layers
    cut = model_cfg.vocab_size  # without model.pad_vocab_to's rows: Hugging Face has the real vocabulary

    def plain(name: str, change: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> Recipe:
        return Recipe((name,), (lambda ts: change(ts[0])[:cut]) if name in VOCAB_ROWS else lambda ts: change(ts[0]))

    def bias(name: str, rows: int) -> Recipe:  # a model without biases: Hugging Face's GPT-2 has them, as zeros
        return plain(name) if name in ours else Recipe((), lambda ts, rows=rows: torch.zeros(rows))

    recipes: dict[str, Recipe] = {}
    if model_cfg.name == "gpt":
        act = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}.get(model_cfg.activation)
        if act is None:
            return f"GPT-2 has no activation {model_cfg.activation!r}"
        recipes.update({f"transformer.{k}": plain(k) for k in ("wte.weight", "wpe.weight", "ln_f.weight")})
        recipes["transformer.ln_f.bias"] = bias("ln_f.bias", d)
        for i in range(n):
            p, h = f"layers.{i}.", f"transformer.h.{i}."
            recipes[h + "attn.c_attn.weight"] = Recipe(tuple(p + f"attn.w{x}.weight" for x in "qkv"),
                                                       lambda ts: torch.cat(ts, 0).t())
            qkv = tuple(p + f"attn.w{x}.bias" for x in "qkv")  # model.bias gives all three or none
            recipes[h + "attn.c_attn.bias"] = Recipe(qkv, torch.cat) if qkv[0] in ours else bias(qkv[0], 3 * d)
            for theirs, mine in GPT2_CONV.items():
                rows = model_cfg.d_ff if mine == "mlp.fc1" else d
                recipes[h + f"{theirs}.weight"] = plain(p + f"{mine}.weight", torch.t)
                recipes[h + f"{theirs}.bias"] = bias(p + f"{mine}.bias", rows)
            for theirs, mine in GPT2_NORMS.items():
                recipes[h + f"{theirs}.weight"] = plain(p + f"{mine}.weight")
                recipes[h + f"{theirs}.bias"] = bias(p + f"{mine}.bias", d)
        config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": model_cfg.vocab_size,
                  "n_positions": model_cfg.max_seq_len, "n_embd": d, "n_layer": n, "n_head": model_cfg.n_heads,
                  "n_inner": model_cfg.d_ff, "activation_function": act, "layer_norm_epsilon": 1e-5,
                  "resid_pdrop": model_cfg.dropout, "embd_pdrop": model_cfg.dropout, "attn_pdrop": 0.0,
                  "tie_word_embeddings": bool(model_cfg.tie_embeddings), "bos_token_id": None, "eos_token_id": None}
    else:
        if model_cfg.bias:
            return "Llama with biases cannot be written as a LlamaForCausalLM (attention_bias and mlp_bias differ)"
        recipes.update({"model.embed_tokens.weight": plain("wte.weight"), "model.norm.weight": plain("ln_f.weight")})
        for i in range(n):
            for theirs, mine in LLAMA_NAMES.items():
                recipes[f"model.layers.{i}.{theirs}.weight"] = plain(f"layers.{i}.{mine}.weight")
        theta = float(model_cfg.rope_theta)
        rope = {"rope_type": "default"}
        if model_cfg.get("rope_scaling", "none") == "llama3":  # as Llama 3.1's config.json says it, for 4.x too
            rope = {"rope_type": "llama3", **{theirs: cast(model_cfg[k]) for k, (theirs, cast) in LLAMA3_ROPE.items()}}
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": model_cfg.vocab_size,
                  "hidden_size": d, "intermediate_size": model_cfg.d_ff, "num_hidden_layers": n,
                  "num_attention_heads": model_cfg.n_heads,
                  "num_key_value_heads": model_cfg.n_kv_heads or model_cfg.n_heads,
                  "max_position_embeddings": model_cfg.max_seq_len, "rms_norm_eps": model_cfg.norm_eps,
                  "rope_theta": theta, "rope_parameters": {**rope, "rope_theta": theta},
                  **({"rope_scaling": rope} if rope["rope_type"] != "default" else {}),
                  "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                  "tie_word_embeddings": bool(model_cfg.tie_embeddings), "bos_token_id": None, "eos_token_id": None}
    if not model_cfg.tie_embeddings:
        recipes["lm_head.weight"] = plain("lm_head.weight")
    return recipes, config


def write_folder(folder: Path, read: Callable[[list[str]], dict[str, torch.Tensor]],
                 shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]], model_cfg,
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES, token_ids: Optional[dict] = None,
                 read_bytes: int = shards.READ_BYTES, metadata: Optional[dict] = None,
                 known: Optional[KnownHashes] = None) -> Union[str, dict]:
    """Write a folder `transformers.AutoModelForCausalLM.from_pretrained` loads from our full weights: read(names)
    makes some of ours (the checkpoint's, a few at a time), shapes: {our name: (shape, dtype)}. The Hugging Face
    tensors are planned from the shapes (on the meta device), then streamed into shards of at most max_shard_bytes,
    each read back and checked (safetensors_shards.write). token_ids: the data's {"eos_token_id", "pad_token_id"}
    (generation stops at the <eos> the model learned). Returns the files written, or why the model cannot be
    expressed (then nothing is written). metadata: more of the files' header metadata (transformers reads
    "format"). known: given each shard's sha256 as written (safetensors_shards.write)."""
    planned = folder_plan(model_cfg, shapes)
    if isinstance(planned, str):
        return planned
    recipes, config = planned
    entries = []
    for name, r in recipes.items():
        meta = r.make([torch.empty(shapes[s][0], dtype=shapes[s][1], device="meta") for s in r.sources]).float()
        entries.append(shards.Entry(name, tuple(meta.shape), meta.dtype))

    def made(group: list[shards.Entry]) -> dict[str, torch.Tensor]:
        ours = read(sorted({s for e in group for s in recipes[e.name].sources}))
        return {e.name: recipes[e.name].make([ours[s] for s in recipes[e.name].sources]).float().contiguous()
                for e in group}

    folder = Path(folder)
    record = shards.write(folder, "model", entries, max_shard_bytes, {**(metadata or {}), "format": "pt"}, read=made,
                          read_bytes=read_bytes, known=known)
    config.update(token_ids or {})
    atomic_write_json(folder / "config.json", {**config, "torch_dtype": "float32"})
    return record


def save_folder(folder: Path, weights: Mapping[str, torch.Tensor], model_cfg,
                max_shard_bytes: int = DEFAULT_SHARD_BYTES, token_ids: Optional[dict] = None) -> Optional[str]:
    """write_folder from weights in memory (a dict) or a Reader of safetensors files; None, or why not."""
    if isinstance(weights, Reader):
        shapes = {k: (weights.shape(k), weights.dtype(k)) for k in weights}
    else:
        shapes = {k: (tuple(t.shape), t.dtype) for k, t in weights.items()}
    done = write_folder(folder, lambda names: {k: weights[k].detach() for k in names}, shapes, model_cfg,
                        max_shard_bytes, token_ids)
    return done if isinstance(done, str) else None
