"""Files that must not be lost: atomic writes, checkpoints, their consolidation and the on-disk formats (DCP, safetensors, Hugging Face folders)."""
