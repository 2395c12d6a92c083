"""Declarative orchestrator for distributed training experiments: `python -m orchestrator`."""
