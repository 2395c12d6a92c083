"""The config language: what a user may write and what it means.

`schema` declares every key (a dataclass per section, a help text and rules per field) and registers it with
Hydra; `validate` checks a composed config before anything launches (types, unknown keys, cross-field rules,
what this machine can run); `resolve` makes `auto` values concrete for this machine; `options` lists the conf/
tree's options and `help` prints them for `--help`; `errors` words a
problem as key / value / rule / fix; `reference` renders the README's key reference from the schema. This package imports nothing else of `orchestrator`; validation may
ask `plugins` (model and data registries, checkpoint manifests) what is known.
"""
