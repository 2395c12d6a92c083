"""The built-in data sources, one module each, registering itself (plugins/data/registry.py): files (data=text, the
user's files of text or records), stdlib (the default: the Python standard library's source), synthetic (random
tokens), megatron (Megatron-LM's indexed datasets, read where they are; its checks before launch are
megatron_checks.py). What several read files with lives beside them in plugins/data (file_heads, file_corpus,
reading, folders, ...)."""
from plugins.data.sources import files, megatron, stdlib, synthetic  # noqa: F401  (register the built-in sources)
