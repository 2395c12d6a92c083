"""Data: the source registry (registry.py), the built-in sources (sources/, one module each), the record formats
(formats/, one module each) and the batcher (batcher.py)."""
from plugins.data.batcher import Batch, Batcher, build_batcher, data_fingerprint
from plugins.data.registry import Corpus, DataSource, get_source, register_source
from plugins.data.tokenizer import EOS, PAD
from plugins.data import sources as _sources  # noqa: F401  (registers the built-in sources)
from plugins.data.formats import chat as _chat, preference as _pairs, prompt_completion as _prompt  # noqa: F401
from plugins.data.formats import text as _text, unpaired as _unpaired  # noqa: F401  (register the formats)

__all__ = ["Batch", "Batcher", "build_batcher", "data_fingerprint", "Corpus", "DataSource",
           "EOS", "PAD", "get_source", "register_source"]
