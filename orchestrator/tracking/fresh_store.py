"""A new sqlite store, copied from an empty one that MLflow migrated once per MLflow version.

Creating a sqlite store runs MLflow's whole chain of schema migrations: about 4 s of CPU on the 2-core VM, paid by
every new runs folder (each test's, each user's first run in a folder), while opening a migrated one takes 0.1 s.
MLflow makes the empty store once (in the user's cache folder, named by MLflow's version, written whole or not at
all); a new store is a copy of it, with what MLflow writes for the store it creates made as it
would have made it: the "Default" experiment's artifact location (./mlruns/0 of the folder the command runs in)
and its times. The copy is checked before it is used (sqlite's own integrity check, one schema revision); a template
that fails the check is made again. MLflow then opens the copy as it opens any store (it refuses one whose schema
is not its own).
"""
from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from pathlib import Path
from typing import Optional


def cache_folder() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "orchestrator"


def _sound(db: Path) -> bool:
    """sqlite's integrity check passes and the store records one schema revision (MLflow, opening it, checks that
    the revision is its own)."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
            return (con.execute("PRAGMA integrity_check").fetchone() == ("ok",)
                    and len(con.execute("SELECT version_num FROM alembic_version").fetchall()) == 1)
    except sqlite3.Error:
        return False


def _template() -> Optional[Path]:
    """The migrated empty store for this MLflow (made now if missing or unsound); None where the cache folder
    cannot be written (the store is then created as MLflow creates it)."""
    import mlflow

    folder = cache_folder()
    template = folder / f"mlflow-{mlflow.__version__}-empty.db"
    if template.exists() and _sound(template):
        return template
    # a name of its own each time: MLflow keeps each store's engine, by URI, for the life of the process
    scratch = folder / f".{template.name}.{os.getpid()}.{time.time_ns()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        logging.getLogger("mlflow").setLevel(logging.WARNING)  # not "Creating initial MLflow database tables..."
        mlflow.MlflowClient(tracking_uri=f"sqlite:///{scratch}").get_experiment("0")  # creates and migrates it
        if not _sound(scratch):
            return None
        os.replace(scratch, template)
    except Exception:  # noqa: BLE001 (no template: MLflow creates the store itself, and says what fails there)
        return None
    finally:
        with contextlib.suppress(OSError):
            scratch.unlink(missing_ok=True)
    return template


def create_from_template(db: Path) -> bool:
    """Make the store `db` (which does not exist: the caller holds the store's lock) as a copy of the template,
    written whole or not at all. False where there is no template to copy (MLflow then creates the store)."""
    template = _template()
    if template is None:
        return False
    scratch = db.with_name(f".{db.name}.{os.getpid()}.new")
    try:
        db.parent.mkdir(parents=True, exist_ok=True)
        scratch.write_bytes(template.read_bytes())
        now = int(time.time() * 1000)
        with contextlib.closing(sqlite3.connect(scratch)) as con, con:
            # as MLflow's SqlAlchemyStore writes it for a store it creates: the default artifact root is ./mlruns
            # of the working folder, made absolute
            con.execute("UPDATE experiments SET artifact_location = ?, creation_time = ?, last_update_time = ? "
                        "WHERE experiment_id = 0", (str(Path("mlruns").resolve() / "0"), now, now))
        if not _sound(scratch):
            return False
        os.replace(scratch, db)
        return True
    except (OSError, sqlite3.Error):  # MLflow creates the store, and says what fails there
        return False
    finally:
        with contextlib.suppress(OSError):
            scratch.unlink(missing_ok=True)
