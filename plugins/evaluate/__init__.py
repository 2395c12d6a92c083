"""Scoring a trained model on tasks (the evaluate stage's library: lm-evaluation-harness)."""
