"""Imported by the fork server when tracking is on (orchestrator/cluster/fork_server.py): MLflow's SQL store and
its ORM mappers, configured once there, so that each stage's rank 0, forked from the server, opens a sqlite store
in milliseconds. Opening it in a fresh process imports SQLAlchemy's ORM, Alembic and MLflow's models and
configures the mappers: about 1 s of CPU per stage, 6 s per tracked run (measured). Nothing here opens a
connection: no file or socket is shared across the fork."""
import sqlalchemy.orm

import mlflow.store.tracking.sqlalchemy_store  # noqa: F401

sqlalchemy.orm.configure_mappers()
