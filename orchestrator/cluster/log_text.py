"""A terminal's output as a log file holds it: the lines as they last stood, without colour or cursor codes.

Rank 0 of a run started from a terminal prints its progress bar through the pipe the launcher tees to the terminal
and to `rank0.out`; the bar redraws its line many times a second (a carriage return, then the line again). The
terminal shows the last drawing; the file got every one (637 KB for a 300-step run). `LogText` keeps, of each line,
what follows its last carriage return, and drops escape sequences (colours, erasing, moving the cursor, hiding it):
the log lines printed above the bar stay, the bar's frames go (a bar that ends in a newline leaves its last frame).
"""
from __future__ import annotations

import codecs
import re

# CSI (colours, erase, cursor moves: ESC [ ... final byte), OSC (titles, links: ESC ] ... BEL or ESC \), and the
# two-byte escapes (ESC 7, ESC =, ...)
ESCAPE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[ -Z\\-~])")
LONGEST_ESCAPE = 256  # an ESC with no end in sight after this many characters is dropped rather than held


UP = re.compile(r"\x1b\[(\d*)A")  # the cursor up n lines (rich erases a finished transient bar so)
HELD_LINES = 1  # complete lines kept back until the next output shows they were not erased (the bar is one line)


class LogText:
    """Fed a stream's chunks as they arrive (an escape sequence or a UTF-8 character may span two), gives back what
    the log file should get: complete lines, plain."""

    def __init__(self):
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.line = ""   # the current line since its last carriage return, plain
        self.held = ""   # an escape sequence cut by the chunk's end
        self.done: list[str] = []  # complete lines not given back yet (HELD_LINES at most)

    def feed(self, data: bytes) -> bytes:
        text = self.held + self.decoder.decode(data)
        self.held = ""
        start = text.rfind("\x1b")
        if start >= 0 and not ESCAPE.match(text, start) and len(text) - start < LONGEST_ESCAPE:
            text, self.held = text[:start], text[start:]  # the rest of it comes with the next chunk
        text = ESCAPE.sub(lambda m: m.group(0) if UP.fullmatch(m.group(0)) else "", text)
        for piece in re.split(r"(\n|\x1b\[\d*A)", text):
            up = UP.fullmatch(piece)
            if piece == "\n":
                self.done.append(self.line + "\n")
                self.line = ""
            elif up:  # the lines above are drawn again (or erased): those still held are dropped
                del self.done[max(0, len(self.done) - int(up.group(1) or 1)):]
                self.line = ""
            elif piece:
                self.line = (self.line + piece.replace("\x1b", "")).rsplit("\r", 1)[-1]  # a stray ESC: dropped
        ready, self.done = self.done[:max(0, len(self.done) - HELD_LINES)], self.done[-HELD_LINES:]
        return "".join(ready).encode()

    def close(self) -> bytes:
        """What is held, and the unfinished last line (a process that ended without a newline)."""
        self.feed(b"")
        rest = "".join(self.done) + self.line
        self.line, self.held, self.done = "", "", []
        return rest.encode()
