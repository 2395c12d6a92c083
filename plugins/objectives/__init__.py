"""Training objectives: the loss a step asks of the label-sparse head's output (dpo.py: preference pairs)."""
