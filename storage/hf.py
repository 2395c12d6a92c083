"""Hugging Face interop: a `save_pretrained` folder of a GPT-2 or Llama model in, a folder `transformers` loads out.

Only files are read and written (config.json, safetensors, sharded as save_pretrained shards them), so importing
needs neither `transformers` nor a network; the tests check both directions against `transformers` itself. Both
directions go one tensor at a time: a rank imports only what it holds, and an export holds one shard. Names map one to one, except GPT-2's
Conv1D layers, which store (in, out) where a Linear stores (out, in), and its fused q/k/v projection `c_attn`.
Llama's q/k projections are stored by Hugging Face in the layout its rotate-half RoPE expects, which is ours.
"""
from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional

import torch

from storage import safetensors_shards as shards
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
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise HFError(f"rope scaling {rope.get('rope_type', rope.get('type'))!r} is not supported (only the default "
                      "rotary embedding)")
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
                    "tie_embeddings": c.get("tie_word_embeddings", False), "bias": False}


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
    """A folder's weights under our parameter names, each read from the files when asked for (fp32, contiguous):
    a rank that holds a shard of a layer reads that layer's tensors, never the whole model."""

    def __init__(self, recipes: dict[str, Callable[[], torch.Tensor]]):
        self._recipes = recipes

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._recipes[name]().contiguous()

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


def load_state(folder: Path, vocab_rows: Optional[int] = None) -> Weights:
    """The folder's weights under our parameter names (fp32), read lazily; with vocab_rows, the embedding and head
    padded with zero rows to that many (model.pad_vocab_to: the padding's logits never count)."""
    family, cfg = read_config(folder)
    reader = _reader(folder)
    names = {re.sub(r"^(transformer|model)\.", "", k): k for k in reader}

    def get(short: str) -> torch.Tensor:
        return reader[names[short]].float()

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
            recipes[k] = partial(_padded, recipes[k], vocab_rows)
    return Weights(recipes)


def _fused_part(get, short: str, weight: bool, d: int, j: int) -> torch.Tensor:
    fused = get(short)
    return (fused.t() if weight else fused).split(d, dim=0)[j]


def _conv(get, short: str, weight: bool) -> torch.Tensor:
    return get(short).t() if weight else get(short)


def _padded(make: Callable[[], torch.Tensor], rows: int) -> torch.Tensor:
    t = make()
    return torch.cat([t, t.new_zeros(rows - t.shape[0], t.shape[1])]) if t.shape[0] < rows else t


def save_folder(folder: Path, weights: Mapping[str, torch.Tensor], model_cfg,
                max_shard_bytes: int = DEFAULT_SHARD_BYTES, token_ids: Optional[dict] = None) -> Optional[str]:
    """Write a folder `transformers.AutoModelForCausalLM.from_pretrained` loads, from our full (fp32) weights (a dict,
    or a Reader of the aggregated files: read one Hugging Face tensor at a time, written in shards of at most
    max_shard_bytes). token_ids: the data's {"eos_token_id", "pad_token_id"} (generation stops at the <eos> the
    model learned). Returns why not when the model cannot be expressed (then nothing is written)."""
    folder = Path(folder)
    d, n = model_cfg.d_model, model_cfg.n_layers

    def ours(name: str, on_meta: bool) -> torch.Tensor:
        if on_meta:  # shapes only: the sizes of the shards are planned before anything is read
            shape = weights.shape(name) if isinstance(weights, Reader) else weights[name].shape  # no read
            t = torch.empty(shape, device="meta")
        else:
            t = weights[name].detach().float()
        # without model.pad_vocab_to's rows: Hugging Face has the real vocabulary
        return t[:model_cfg.vocab_size] if name in VOCAB_ROWS else t

    def bias(name: str, rows: int, on_meta: bool) -> torch.Tensor:
        return ours(name, on_meta) if name in weights else torch.zeros(rows, device="meta" if on_meta else "cpu")

    recipes: dict[str, Callable[[bool], torch.Tensor]] = {}
    if model_cfg.name == "gpt":
        act = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}.get(model_cfg.activation)
        if act is None:
            return f"GPT-2 has no activation {model_cfg.activation!r}"
        recipes.update({f"transformer.{k}": partial(ours, k) for k in ("wte.weight", "wpe.weight", "ln_f.weight")})
        recipes["transformer.ln_f.bias"] = partial(bias, "ln_f.bias", d)
        for i in range(n):
            p, h = f"layers.{i}.", f"transformer.h.{i}."
            recipes[h + "attn.c_attn.weight"] = lambda m, p=p: torch.cat([ours(p + f"attn.w{x}.weight", m)
                                                                          for x in "qkv"], 0).t()
            recipes[h + "attn.c_attn.bias"] = lambda m, p=p: torch.cat([bias(p + f"attn.w{x}.bias", d, m)
                                                                        for x in "qkv"])
            for theirs, mine in GPT2_CONV.items():
                rows = model_cfg.d_ff if mine == "mlp.fc1" else d
                recipes[h + f"{theirs}.weight"] = lambda m, k=p + f"{mine}.weight": ours(k, m).t()
                recipes[h + f"{theirs}.bias"] = partial(bias, p + f"{mine}.bias", rows)
            for theirs, mine in GPT2_NORMS.items():
                recipes[h + f"{theirs}.weight"] = partial(ours, p + f"{mine}.weight")
                recipes[h + f"{theirs}.bias"] = partial(bias, p + f"{mine}.bias", d)
        config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": model_cfg.vocab_size,
                  "n_positions": model_cfg.max_seq_len, "n_embd": d, "n_layer": n, "n_head": model_cfg.n_heads,
                  "n_inner": model_cfg.d_ff, "activation_function": act, "layer_norm_epsilon": 1e-5,
                  "resid_pdrop": model_cfg.dropout, "embd_pdrop": model_cfg.dropout, "attn_pdrop": 0.0,
                  "tie_word_embeddings": bool(model_cfg.tie_embeddings), "bos_token_id": None, "eos_token_id": None}
    else:
        if model_cfg.bias:
            return "Llama with biases cannot be written as a LlamaForCausalLM (attention_bias and mlp_bias differ)"
        recipes.update({"model.embed_tokens.weight": partial(ours, "wte.weight"),
                        "model.norm.weight": partial(ours, "ln_f.weight")})
        for i in range(n):
            for theirs, mine in LLAMA_NAMES.items():
                recipes[f"model.layers.{i}.{theirs}.weight"] = partial(ours, f"layers.{i}.{mine}.weight")
        theta = float(model_cfg.rope_theta)
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": model_cfg.vocab_size,
                  "hidden_size": d, "intermediate_size": model_cfg.d_ff, "num_hidden_layers": n,
                  "num_attention_heads": model_cfg.n_heads,
                  "num_key_value_heads": model_cfg.n_kv_heads or model_cfg.n_heads,
                  "max_position_embeddings": model_cfg.max_seq_len, "rms_norm_eps": model_cfg.norm_eps,
                  "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
                  "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                  "tie_word_embeddings": bool(model_cfg.tie_embeddings), "bos_token_id": None, "eos_token_id": None}
    if not model_cfg.tie_embeddings:
        recipes["lm_head.weight"] = partial(ours, "lm_head.weight")
    entries = [shards.Entry(k, tuple(planned.shape), planned.dtype, partial(make, False))
               for k, make in recipes.items() for planned in [make(True)]]
    shards.write(folder, "model", entries, max_shard_bytes, metadata={"format": "pt"})
    config.update(token_ids or {})
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}, indent=2) + "\n")
    return None
