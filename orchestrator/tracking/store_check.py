"""tracking's check before launch: the MLflow store can be created or opened, or its server answers."""
from __future__ import annotations

from common.problem import Problem
from orchestrator.tracking.tracker import sqlite_file

TRACKING_TIMEOUT_S = 5.0  # an MLflow server that does not answer this fast is reported before launch


def check(cfg) -> list:
    """The MLflow store can be created or opened, or the server answers (MLflow itself would retry a dead server
    for minutes before saying anything)."""
    from storage.fsio import why_unwritable

    t = cfg.tracking
    if t.name != "mlflow":
        return []
    if not str(t.experiment).strip():  # MLflow's own refusal comes after the stages ran, as a traceback
        return [Problem("tracking.experiment", t.experiment, "an MLflow experiment needs a name",
                        "tracking.experiment=orchestrator (the default), or another name")]
    uri, fix = t.uri, "tracking=none, or a local store: tracking.uri=sqlite:///runs/mlflow.db"
    db = sqlite_file(uri)
    if db is not None:
        if not db.exists():
            why = why_unwritable(db.parent)
            return [Problem("tracking.uri", uri, f"the sqlite store cannot be created: {why}", fix)] if why else []
        import sqlite3

        try:
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=TRACKING_TIMEOUT_S) as con:
                con.execute("SELECT count(*) FROM sqlite_master").fetchone()
        except sqlite3.Error as e:
            return [Problem("tracking.uri", uri, f"{db} cannot be read as an MLflow store ({e})",
                            f"move the file aside (MLflow creates a new store), or {fix}")]
    elif uri.split(":", 1)[0].split("+", 1)[0] in DATABASES:
        return _database_problems(uri, fix)
    elif uri.startswith("databricks"):
        return []  # credentials come from the environment or ~/.databrickscfg: MLflow reports their absence itself
    elif not uri.startswith(("http://", "https://")):
        scheme = uri.split("://", 1)[0] if "://" in uri else ""
        what = f"the scheme {scheme}:// is not an MLflow store" if scheme and scheme != "file" else \
            "a folder (or file:) store is MLflow's filesystem backend, which MLflow 3 keeps in maintenance mode " \
            "and refuses to open"
        return [Problem("tracking.uri", uri, f"{what}; the stores that work: sqlite:///<file>, http(s)://<server>, "
                        f"or a database ({', '.join(s + '://' for s in DATABASES)}, with its Python driver)",
                        "tracking.uri=sqlite:///<folder>/mlflow.db, or tracking=none")]
    else:
        import urllib.error
        import urllib.request

        try:
            urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=TRACKING_TIMEOUT_S).close()
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            return [Problem("tracking.uri", uri, f"no MLflow server answers there within {TRACKING_TIMEOUT_S:.0f} s "
                            f"({reason})", f"start it (mlflow server --host ... --port ...), or {fix}")]
    return []


DATABASES = {"postgresql": 5432, "mysql": 3306, "mssql": 1433}  # MLflow's SQL stores, and their default ports
DRIVER_PACKAGES = {"psycopg": "psycopg[binary]", "psycopg2": "psycopg2-binary", "mysqldb": "mysqlclient",
                   "pymysql": "PyMySQL", "pyodbc": "pyodbc", "pymssql": "pymssql"}


def _database_problems(uri: str, fix: str) -> list:
    """A database store: its driver is installed (SQLAlchemy would raise ModuleNotFoundError in every stage) and
    its server accepts a TCP connection."""
    import socket

    from sqlalchemy.engine.url import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError


    try:
        url = make_url(uri)
        url.get_dialect().import_dbapi()
    except (ArgumentError, NoSuchModuleError, ValueError) as e:
        return [Problem("tracking.uri", uri, f"not a database URL SQLAlchemy can read ({e})",
                        "tracking.uri=postgresql://<user>:<password>@<host>:<port>/<database>, or " + fix)]
    except ImportError as e:
        driver = url.get_driver_name()
        package = DRIVER_PACKAGES.get(driver, driver)
        return [Problem("tracking.uri", uri, f"a {url.get_backend_name()} store needs its Python driver {driver}, "
                        f"which is not installed ({e})", f"pip install '{package}' -c constraints.txt, or {fix}")]
    port = url.port or DATABASES[url.get_backend_name()]
    try:
        socket.create_connection((url.host or "127.0.0.1", port), timeout=TRACKING_TIMEOUT_S).close()
    except OSError as e:
        return [Problem("tracking.uri", uri, f"no database server answers at {url.host or '127.0.0.1'}:{port} "
                        f"({e.strerror or e})", f"start it, or {fix}")]
    return []
