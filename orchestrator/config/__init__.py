"""The config language: what a user may write and what it means.

`schema` declares every key (a dataclass per section, a help text and rules per field) and registers it with
Hydra; `validate` checks a composed config before anything launches: it walks the schema (types, unknown keys,
bounds) and collects the rules of the config's owners, each a `check(cfg)` beside what it constrains (the model
registry, the layout, the data, the engine, the runtime, the cluster executors, tracking, the plan); `resolve`
makes `auto` values concrete for this machine; `options` lists the conf/ tree's options and `help` prints them
for `--help`; `errors` words a problem as key / value / rule / fix; `reference` renders docs/configuration.md's
key reference from the schema. This package imports nothing else of `orchestrator`, except the rules validation
collects (orchestrator.cluster.rules, orchestrator.tracking.store_check).
"""
