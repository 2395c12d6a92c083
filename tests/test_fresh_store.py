"""A new sqlite store is a copy of an empty one MLflow migrated once (orchestrator/tracking/fresh_store.py): the
store MLflow would have made, made without its migrations; a template that does not check out is made again."""
from __future__ import annotations

import contextlib
import sqlite3

import mlflow

from orchestrator.tracking import fresh_store
from orchestrator.tracking.tracker import _new_store_client


def rows(db, query: str) -> list:
    with contextlib.closing(sqlite3.connect(db)) as con:
        return con.execute(query).fetchall()


def test_a_new_store_is_the_template_copied_as_mlflow_would_have_made_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    made = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'by_mlflow.db'}").get_experiment("0")  # MLflow's own

    first = _new_store_client(f"sqlite:///{tmp_path / 'a' / 'mlflow.db'}")
    (template,) = (tmp_path / "cache" / "orchestrator").glob("mlflow-*-empty.db")
    made_at = template.stat().st_mtime_ns
    copied = first.get_experiment("0")
    assert (copied.name, copied.artifact_location) == (made.name, made.artifact_location)
    assert rows(tmp_path / "a" / "mlflow.db", "SELECT * FROM alembic_version") == \
        rows(tmp_path / "by_mlflow.db", "SELECT * FROM alembic_version")
    run = first.create_run(first.create_experiment("orchestrator")).info.run_id
    first.log_metric(run, "loss", 1.5)
    assert first.get_run(run).data.metrics == {"loss": 1.5}

    _new_store_client(f"sqlite:///{tmp_path / 'b' / 'mlflow.db'}").get_experiment("0")
    assert template.stat().st_mtime_ns == made_at  # copied again, not migrated again

    template.write_bytes(b"not a database")  # a damaged template is made again, and the store with it
    third = _new_store_client(f"sqlite:///{tmp_path / 'c' / 'mlflow.db'}")
    assert third.get_experiment("0").artifact_location == made.artifact_location
    assert fresh_store._sound(template)
    assert not list((tmp_path / "c").glob(".*"))  # no scratch copy left beside the store


def test_without_a_writable_cache_mlflow_creates_the_store(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))  # a file: no folder can be made under it
    assert fresh_store.create_from_template(tmp_path / "s" / "mlflow.db") is False
    client = _new_store_client(f"sqlite:///{tmp_path / 's' / 'mlflow.db'}")
    assert client.get_experiment("0").name == "Default"
