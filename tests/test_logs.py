"""The one log format (tokenforge/logs.py): records go to the stderr of the moment they are written."""

from __future__ import annotations

import io
import logging
import sys

from tokenforge.logs import configure_logging


def test_records_follow_stderr_when_it_is_swapped_and_the_old_one_closed(monkeypatch):
    """A caller that swaps sys.stderr and closes the old stream (pytest's capture, a notebook cell)
    must not get "I/O operation on closed file" for every record written afterwards."""
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("info", "tag")
        logging.getLogger("tokenforge.test").info("before %d", 1)
        first.close()
        monkeypatch.setattr(sys, "stderr", second)
        errors = []
        monkeypatch.setattr(logging.Handler, "handleError", lambda self, record: errors.append(record))
        logging.getLogger("tokenforge.test").warning("after %d", 2)
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    assert errors == []
    assert second.getvalue().endswith(" WARNING [tag] tokenforge.test: after 2\n"), second.getvalue()
