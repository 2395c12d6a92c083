"""`python -m orchestrator --help`: the config groups and their options, the common commands, where to read more."""
from __future__ import annotations

from orchestrator.config.options import options_of
from orchestrator.config.schema import GROUP_SCHEMAS

COMMANDS = [
    ("python -m orchestrator", "the default experiment: tiny GPT, one process, every stage"),
    ("python -m orchestrator model=llama_tiny parallel=dp2_hp2_pp2", "pick options (8 ranks: dp x hp x pp)"),
    ("python -m orchestrator optimizer.lr=3e-4 train.steps=1000", "set keys (unchanged stages come from the cache)"),
    ("python -m orchestrator -m optimizer.lr=1e-3,3e-4", "a sweep (-m): every point checked before any runs"),
    ("python -m orchestrator data=chat 'data.paths=[chats.jsonl]' train.init_from=hf:/path/to/llama "
     "model=llama_1b data.preview=2", "fine-tuning on chats: the first two as the model sees them (drop "
     "data.preview to train)"),
    ("python -m orchestrator peft=lora train.init_from=hf:/path/to/llama model=llama_1b data=text "
     "'data.paths=[corpus]'",
     "LoRA adapters on a Hugging Face model (its own tokenizer: data.tokenizer=auto)"),
    ("python -m orchestrator 'evaluate.tasks=[arith_mc,val_perplexity]' train.steps=0 "
     "train.init_from=hf:/path/to/llama model=llama_1b",
     "score a model with lm-eval as it is (train.steps=0: a baseline)"),
    ("python -m orchestrator cluster=slurm dry_run=true", "print the plan and the sbatch scripts; start nothing"),
    ("python -m orchestrator --cfg job", "print the composed config"),
]


def help_text() -> str:
    width = max(len(g) for g in GROUP_SCHEMAS)
    lines = ["usage: python -m orchestrator [group=option ...] [key=value ...] [-m for a sweep]", "",
             "A declarative orchestrator for distributed training experiments: it plans the stages tokenize, export,",
             "transform, train, checkpoint, aggregate (and evaluate), runs those not already in the cache, and logs",
             "to MLflow.", "",
             "Config groups (group=option; the first is the default):"]
    for group in GROUP_SCHEMAS:
        lines.append(f"  {group:<{width}}  {', '.join(options_of(group))}")
    lines += ["", "Common commands:"]
    lines += [f"  {cmd}\n      {what}" for cmd, what in COMMANDS]
    lines += ["", "Every key, its default and its meaning: docs/configuration.md (generated from",
              "orchestrator/config/schema/). Bad values are refused before anything starts, naming the key, the",
              "value, the rule and a fix (exit status 2). Hydra's own help: --hydra-help."]
    return "\n".join(lines)
