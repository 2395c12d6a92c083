"""An exception's traceback kept in a file, so that what the user reads is one line that says where it is."""
from __future__ import annotations

import datetime
import os
import tempfile
import traceback
from pathlib import Path


def saved(exc: BaseException) -> str:
    """'the traceback is in <file>' (or why it could not be saved)."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = Path(tempfile.gettempdir()) / f"orchestrator-error-{stamp}-{os.getpid()}.txt"
    try:
        path.write_text("".join(traceback.format_exception(exc)))
        return f"the traceback is in {path}"
    except OSError as e:
        return f"its traceback could not be saved ({e.strerror})"


def said(exc: BaseException) -> str:
    """The exception in one line: its type and the first line of its text."""
    text = str(exc).strip()
    return f"{type(exc).__name__}{': ' + text.splitlines()[0] if text else ''}"
