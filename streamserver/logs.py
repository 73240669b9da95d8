"""Fields on log lines: `room_id`, `student_id`, `utterance_id` and `gateway` as JSON fields
(`--log-format json`) wherever a line is about one of them, so that a log system filters by
them instead of searching the message text.

A line names them in its `extra` (`log.info("...", extra=fields(room_id=...))`), or a block of
code binds them for every line logged within it, its tasks included (`with bound(...)`: a
context variable, which asyncio copies into each task it starts). The process's own fields
(`gateway`: the instance's name) are set once at start. A value is an id the server issued,
never a token; any `token=` in one is redacted as in a message.
"""

from __future__ import annotations

import contextlib
import logging
import re
from contextvars import ContextVar
from typing import Iterator

FIELDS = ("room_id", "student_id", "utterance_id", "gateway")
_EXTRA = "fields"  # the LogRecord attribute `extra=fields(...)` sets
_TOKEN = re.compile(r"(token=)[^&\s\"']+")
_bound: ContextVar[dict[str, str]] = ContextVar("log_fields", default={})
_process: dict[str, str] = {}


def _clean(values: dict[str, object]) -> dict[str, str]:
    unknown = set(values) - set(FIELDS)
    if unknown:  # one spelling per field, or a log system filters on two names for one thing
        raise ValueError(f"log fields are {', '.join(FIELDS)}, not {', '.join(sorted(unknown))}")
    return {k: redact(str(v)) for k, v in values.items() if v is not None}


def redact(text: str) -> str:
    """`token=` values (a URL's query) in a message or a field, replaced."""
    return _TOKEN.sub(r"\1<redacted>", text)


def fields(**values: object) -> dict[str, dict[str, str]]:
    """For a log call's `extra`: these fields on this line."""
    return {_EXTRA: _clean(values)}


@contextlib.contextmanager
def bound(**values: object) -> Iterator[None]:
    """These fields on every line logged within the block (and the tasks it starts)."""
    token = _bound.set({**_bound.get(), **_clean(values)})
    try:
        yield
    finally:
        _bound.reset(token)


def set_process_fields(**values: object) -> None:
    """Fields of every line of this process (the gateway's name)."""
    _process.update(_clean(values))


def fields_of(record: logging.LogRecord) -> dict[str, str]:
    """The fields of a record: the process's, then the bound ones, then the line's own."""
    return {**_process, **_bound.get(), **getattr(record, _EXTRA, {})}
