"""MLflow: tracker (one parent run per invocation, a child per stage; the store checked before launch), later (a run
with nothing to do recorded by a detached process), resync (`python -m orchestrator.tracking.resync <run folder>`)."""
