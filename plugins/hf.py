"""Hugging Face interop: a `save_pretrained` folder of a GPT-2 or Llama model in, a folder `transformers` loads out.

Only files are read and written (config.json, safetensors), so importing needs neither `transformers` nor a
network; the tests check both directions against `transformers` itself. Names map one to one, except GPT-2's
Conv1D layers, which store (in, out) where a Linear stores (out, in), and its fused q/k/v projection `c_attn`.
Llama's q/k projections are stored by Hugging Face in the layout its rotate-half RoPE expects, which is ours.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

PREFIX = "hf:"
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


def _hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise HFError(f"{folder} holds no *.safetensors weights (save with safe_serialization=True)")
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            out.update({k: handle.get_tensor(k) for k in handle.keys()})
    return out


VOCAB_ROWS = ("wte.weight", "lm_head.weight")  # the parameters model.pad_vocab_to pads


def load_state(folder: Path, vocab_rows: Optional[int] = None) -> dict[str, torch.Tensor]:
    """The folder's weights under our parameter names (fp32); with vocab_rows, the embedding and head padded with
    zero rows to that many (model.pad_vocab_to: the padding's logits never count)."""
    family, cfg = read_config(folder)
    hf = {re.sub(r"^(transformer|model)\.", "", k): v.float() for k, v in _hf_tensors(folder).items()}
    ours: dict[str, torch.Tensor] = {}
    if family == "gpt":
        d = cfg["d_model"]
        for k, v in hf.items():
            m = re.match(r"h\.(\d+)\.(.+)$", k)
            if not m:
                name = {"wte.weight": "wte.weight", "wpe.weight": "wpe.weight", "ln_f.weight": "ln_f.weight",
                        "ln_f.bias": "ln_f.bias", "lm_head.weight": "lm_head.weight"}.get(k)
                if name:
                    ours[name] = v
                continue
            i, rest = m.groups()
            pre = f"layers.{i}."
            if rest.startswith("attn.c_attn."):
                leaf = rest.rsplit(".", 1)[1]
                q, kk, vv = (v.t() if leaf == "weight" else v).split(d, dim=0)
                ours.update({pre + f"attn.wq.{leaf}": q, pre + f"attn.wk.{leaf}": kk, pre + f"attn.wv.{leaf}": vv})
                continue
            conv = {"attn.c_proj": "attn.wo", "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
            plain = {"ln_1": "ln1", "ln_2": "ln2"}
            module, leaf = rest.rsplit(".", 1)
            if module in conv:
                ours[pre + f"{conv[module]}.{leaf}"] = v.t() if leaf == "weight" else v
            elif module in plain:
                ours[pre + f"{plain[module]}.{leaf}"] = v
    else:
        names = {"self_attn.q_proj": "attn.wq", "self_attn.k_proj": "attn.wk", "self_attn.v_proj": "attn.wv",
                 "self_attn.o_proj": "attn.wo", "mlp.gate_proj": "mlp.fc1", "mlp.up_proj": "mlp.fc3",
                 "mlp.down_proj": "mlp.fc2", "input_layernorm": "ln1", "post_attention_layernorm": "ln2"}
        for k, v in hf.items():
            m = re.match(r"layers\.(\d+)\.(.+)\.weight$", k)
            if m and m.group(2) in names:
                ours[f"layers.{m.group(1)}.{names[m.group(2)]}.weight"] = v
            elif k in ("embed_tokens.weight", "norm.weight", "lm_head.weight"):
                ours[{"embed_tokens.weight": "wte.weight", "norm.weight": "ln_f.weight"}.get(k, k)] = v
    if cfg["tie_embeddings"]:
        ours.pop("lm_head.weight", None)
    for k in VOCAB_ROWS:
        if vocab_rows and k in ours and ours[k].shape[0] < vocab_rows:
            ours[k] = torch.cat([ours[k], ours[k].new_zeros(vocab_rows - ours[k].shape[0], ours[k].shape[1])])
    return {k: v.contiguous() for k, v in ours.items()}


def save_folder(folder: Path, state: dict[str, torch.Tensor], model_cfg) -> Optional[str]:
    """Write a folder `transformers.AutoModelForCausalLM.from_pretrained` loads, from our full (fp32) state.
    Returns why not when the model cannot be expressed (then nothing is written)."""
    folder = Path(folder)
    state = {k: (v[:model_cfg.vocab_size] if k in VOCAB_ROWS else v).detach().float().contiguous()
             for k, v in state.items()}  # without model.pad_vocab_to's rows: Hugging Face has the real vocabulary
    if model_cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    n, d = model_cfg.n_layers, model_cfg.d_model
    if model_cfg.name == "gpt":
        act = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "silu": "silu"}.get(model_cfg.activation)
        if act is None:
            return f"GPT-2 has no activation {model_cfg.activation!r}"
        zeros = torch.zeros
        hf = {"transformer.wte.weight": state["wte.weight"], "transformer.wpe.weight": state["wpe.weight"],
              "transformer.ln_f.weight": state["ln_f.weight"],
              "transformer.ln_f.bias": state.get("ln_f.bias", zeros(d))}
        for i in range(n):
            p, h = f"layers.{i}.", f"transformer.h.{i}."

            def w(name, rows):
                return state.get(p + name, zeros(rows))
            hf[h + "attn.c_attn.weight"] = torch.cat([state[p + f"attn.w{x}.weight"] for x in "qkv"], 0).t().contiguous()
            hf[h + "attn.c_attn.bias"] = torch.cat([w(f"attn.w{x}.bias", d) for x in "qkv"])
            hf[h + "attn.c_proj.weight"] = state[p + "attn.wo.weight"].t().contiguous()
            hf[h + "attn.c_proj.bias"] = w("attn.wo.bias", d)
            hf[h + "mlp.c_fc.weight"] = state[p + "mlp.fc1.weight"].t().contiguous()
            hf[h + "mlp.c_fc.bias"] = w("mlp.fc1.bias", model_cfg.d_ff)
            hf[h + "mlp.c_proj.weight"] = state[p + "mlp.fc2.weight"].t().contiguous()
            hf[h + "mlp.c_proj.bias"] = w("mlp.fc2.bias", d)
            for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
                hf[h + f"{theirs}.weight"] = state[p + f"{ours}.weight"]
                hf[h + f"{theirs}.bias"] = w(f"{ours}.bias", d)
        config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": model_cfg.vocab_size,
                  "n_positions": model_cfg.max_seq_len, "n_embd": d, "n_layer": n, "n_head": model_cfg.n_heads,
                  "n_inner": model_cfg.d_ff, "activation_function": act, "layer_norm_epsilon": 1e-5,
                  "resid_pdrop": model_cfg.dropout, "embd_pdrop": model_cfg.dropout, "attn_pdrop": 0.0,
                  "tie_word_embeddings": bool(model_cfg.tie_embeddings), "bos_token_id": None, "eos_token_id": None}
    else:
        if model_cfg.bias:
            return "Llama with biases cannot be written as a LlamaForCausalLM (attention_bias and mlp_bias differ)"
        names = {"attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
                 "attn.wo": "self_attn.o_proj", "mlp.fc1": "mlp.gate_proj", "mlp.fc3": "mlp.up_proj",
                 "mlp.fc2": "mlp.down_proj", "ln1": "input_layernorm", "ln2": "post_attention_layernorm"}
        hf = {"model.embed_tokens.weight": state["wte.weight"], "model.norm.weight": state["ln_f.weight"]}
        for i in range(n):
            for ours, theirs in names.items():
                hf[f"model.layers.{i}.{theirs}.weight"] = state[f"layers.{i}.{ours}.weight"]
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
        hf["lm_head.weight"] = state["lm_head.weight"]
    folder.mkdir(parents=True, exist_ok=True)
    save_file(hf, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}, indent=2) + "\n")
    return None
