"""peft.*'s checks before launch: adapters on Linears the model has, of a rank the layer can hold, on a base that is
named (train.init_from=hf:), in a layout and an engine that train them."""
from __future__ import annotations

from common.problem import Problem
from plugins.models.lora import GROUPS, target_names, targets


def check(cfg) -> list[Problem]:
    p = cfg.peft
    if p.name != "lora":
        return []
    from plugins.models.registry import build_on_meta, get_model

    model = build_on_meta(get_model(cfg.model.name), cfg.model)
    every = {n for group in GROUPS.values() for n in group}
    block = {name.split(".", 2)[2] for name, m in targets(model, every) if name.startswith("layers.0.")}
    have = sorted({n.rsplit(".", 1)[-1] for n in block})
    out = []
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
    if not (cfg.train.init_from or "").startswith("hf:"):
        out.append(Problem("train.init_from", cfg.train.init_from, "LoRA trains adapters beside a base model's "
                           "frozen weights: the base must be named (a Hugging Face folder)",
                           "train.init_from=hf:<the base model's folder>"))
    if cfg.engine.name != "torch":
        out.append(Problem("engine.name", cfg.engine.name, "ONNX Runtime's exported units take the base weights as "
                           "their parameters: the adapters beside them are not in the graphs", "engine=torch"))
    return out

