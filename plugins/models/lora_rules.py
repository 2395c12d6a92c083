"""peft.*'s checks before launch: adapters on Linears the model has, of a rank the layer can hold, on a base that is
named (train.init_from=hf:, or a LoRA checkpoint, which names its base: its adapters go on, in any layout), in an
engine that trains them."""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from common.problem import Problem
from storage import hf, init_from
from storage.adapters import base_of
from storage.fsio import read_json
from plugins.models.lora import GROUPS, target_names, targets


def check(cfg) -> list[Problem]:
    p = cfg.peft
    if p.name != "lora":
        return []
    if cfg.train.steps == 0:  # LoRA's B starts at zero: untrained adapters add nothing to the base they sit on
        return [Problem("peft.name", p.name, "train.steps=0 takes no step, so the adapters keep their initial "
                        "values (B = 0) and add nothing: the \"baseline\" would be train.init_from's base with zero "
                        "adapters beside it", "peft=none (train.steps=0 then scores the base as it is), or "
                        "train.steps=300 to train the adapters")]
    from plugins.models.registry import build_on_meta, get_model

    model = build_on_meta(get_model(cfg.model.name), cfg.model)
    out = []
    if p.alpha == 0:  # the adapters' output is scaled by alpha / rank: with 0 nothing they learn reaches the model
        out.append(Problem("peft.alpha", p.alpha, "the adapters' output is scaled by peft.alpha / peft.rank, so with "
                           "0 they add nothing to the model and get no gradient: the run would train nothing",
                           f"peft.alpha={2 * p.rank} (twice the rank, a common choice), or peft=none"))
    every = {n for group in GROUPS.values() for n in group}
    block = {name.split(".", 2)[2] for name, m in targets(model, every) if name.startswith("layers.0.")}
    have = sorted({n.rsplit(".", 1)[-1] for n in block})
    for t in p.targets:
        if t not in GROUPS and t not in have:
            out.append(Problem("peft.targets", t, f"model={cfg.model.name} has no Linear of that name in its blocks "
                               f"(it has {', '.join(have)}; groups: attention, mlp)", f"peft.targets=[{have[0]}] "
                               "or peft.targets=[attention,mlp]"))
    chosen = targets(model, target_names(p))
    if not chosen and not out:
        out.append(Problem("peft.targets", list(p.targets), "no Linear of the model is targeted",
                           "peft.targets=[attention,mlp]"))
    smallest = min((min(m.weight.shape) for _, m in chosen), default=p.rank)
    if p.rank > smallest:
        out.append(Problem("peft.rank", p.rank, f"a rank above the smallest targeted layer's side ({smallest}) is no "
                           "longer low-rank: the adapter cannot be more than the weight", f"peft.rank={smallest // 2 or 1}"))
    names = [n for n, _ in model.named_parameters()]
    for t in p.trainable:
        if t != "bias" and not any(n == t or n.endswith("." + t) for n in names):
            out.append(Problem("peft.trainable", t, f"model={cfg.model.name} has no parameter of that name",
                               "peft.trainable=[bias], or a parameter's name (lm_head.weight, ln_f.weight)"))
        elif t == "bias" and not any(n.endswith(".bias") for n in names):
            out.append(Problem("peft.trainable", t, f"model={cfg.model.name} has no biases (model.bias=false)",
                               "peft.trainable=[]"))
    out += _base_problems(cfg)
    if cfg.engine.name != "torch":
        out.append(Problem("engine.name", cfg.engine.name, "ONNX Runtime's exported units take the base weights as "
                           "their parameters: the adapters beside them are not in the graphs", "engine=torch"))
    return out


# what a continued LoRA checkpoint's adapters were trained as: another value is another function of the same weights
SHAPING = ("rank", "alpha", "targets", "trainable")


def _base_problems(cfg) -> list[Problem]:
    """The base: named, and, where a LoRA checkpoint is continued, the one its adapters were trained on (its files as
    they were) and the adapters' settings as they were."""
    start, base = cfg.train.init_from, base_of(cfg.train.init_from)
    if not base:
        return [Problem("train.init_from", start, "peft.name=lora trains adapters beside a base model's frozen "
                        "weights: the base must be named, a Hugging Face folder (or a LoRA checkpoint, which names "
                        "its own)"
                        + (": this checkpoint holds a full fine-tune" if start else ""),
                        "train.init_from=hf:<the base model's folder>"
                        + (" (a full fine-tune's aggregate writes one: its hf/ folder)" if start else ""))]
    if base == start:
        return []  # the folder itself is checked with train.init_from's rules
    problems = [Problem(p.key, p.value, f"the checkpoint's base, {base}: {p.rule}", p.fix)
                for p in init_from.hf_problems(cfg, base)]
    if problems:
        return problems
    from storage.checkpoint import MANIFEST

    trained = read_json(Path(start) / MANIFEST)["peft"]
    if hf.stamps(hf.folder_of(base)) != trained["base"]["stamps_sha256"]:
        problems.append(Problem("train.init_from", start, f"the checkpoint's adapters were trained on {base}, whose "
                                "files have changed since (names, sizes or modification times): on other weights "
                                "they are another model", f"put the base back as it was, or train adapters afresh "
                                f"on it: train.init_from={base}"))
    ours = OmegaConf.to_container(cfg.peft, resolve=True)  # as the train stage writes it in the manifest
    for key in SHAPING:
        was, now = trained["config"].get(key), ours[key]
        if key == "targets" and was is not None:  # the Linears adapted, however named: [attention,mlp] or each one
            was, now = (sorted(_adapted(cfg, t)) for t in (was, now))
        if was is not None and was != now:
            problems.append(Problem(f"peft.{key}", now, f"the checkpoint's adapters were trained with peft.{key}="
                                    f"{_override(was)}", f"peft.{key}={_override(was)} to continue them (or "
                                    f"train.init_from={base} to start afresh)"))
    return problems


def _adapted(cfg, names: list[str]) -> set[str]:
    """The Linear names that peft.targets=names puts adapters on in this model (groups expanded, absent ones
    dropped)."""
    from plugins.models.registry import build_on_meta, get_model

    model = build_on_meta(get_model(cfg.model.name), cfg.model)
    return {name.rsplit(".", 1)[-1] for name, _ in targets(model, {n for t in names for n in GROUPS.get(t, (t,))})}


def _override(value) -> str:
    """A value as it is written on the command line: [a,b] for a list."""
    return f"[{','.join(value)}]" if isinstance(value, list) else f"{value:g}" if isinstance(value, float) else \
        f"{value}"
