"""Reading back a JSON file fedlb wrote, when the file may be damaged or written by
someone else: one reader for profiles, verdicts, rounds.jsonl, run.json, server.json,
app.json and summary.json.

A file is read only up to a size bound (a 1 GB profile is refused before it is read, not
parsed into 2.4 GB of objects), nested only so deep (200 k `[` is a RecursionError inside
json, and deep values crash whatever walks them later), with finite numbers only (NaN,
Infinity, 1e999 and 10^5000 are refused: nothing fedlb writes holds them). What is wrong
comes as `StoredFileError`, one line naming the file (and line, for JSON lines) and the
fault; whoever reads says what to do, or sets the file aside (`set_aside`) and goes on as
if it were absent.

Only a regular file is read (`open_stored`, also for the digests and zips fedlb reads
back): a FIFO in its place blocked the open, and every read after it, for ever; a link to
/dev/urandom never ends. Either is refused in one line, before a byte is read.
"""

from __future__ import annotations

import json
import math
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

MAX_JSON_BYTES = 64 * 2**20  # every JSON file fedlb writes is far smaller
MAX_JSON_LINE_BYTES = 2**20  # one line of rounds.jsonl: one silo's round
MAX_JSON_LINES_BYTES = 2**31  # rounds.jsonl, read a line at a time
MAX_DEPTH = 32  # fedlb's own files nest 4 deep at most
MAX_INT_DIGITS = 30  # int("9" * 5000) is refused by Python, and slow below that


class StoredFileError(ValueError):
    """A stored JSON file, or one line of it, that cannot be taken: the message is one
    line, `PATH[ line N]: what is wrong`."""

    def __init__(self, path: Path | str, reason: str, line: int | None = None) -> None:
        self.path = Path(path)
        self.reason = reason
        self.line = line
        where = f"{path} line {line}" if line is not None else str(path)
        super().__init__(f"{where}: {reason}")


def parse_json(data: bytes | str, *, max_depth: int = MAX_DEPTH) -> Any:
    """JSON text, parsed; ValueError in a few words where it is not UTF-8 text, not JSON,
    nested deeper than `max_depth` or holds a number that is not finite or too long."""
    try:
        text = data.decode() if isinstance(data, bytes) else data
    except UnicodeDecodeError as error:
        bad = error.object[error.start]
        raise ValueError(f"not UTF-8 text: byte {error.start + 1} is {bad:#04x}") from None
    try:
        value = json.loads(
            text, parse_constant=_refuse_constant, parse_float=_finite, parse_int=_short_int
        )
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON: {error.msg} at character {error.pos + 1}") from None
    except RecursionError:  # the parser's own guard, around a thousand levels
        raise ValueError(f"nested deeper than {max_depth} levels") from None
    if _depth(value) > max_depth:
        raise ValueError(f"nested deeper than {max_depth} levels")
    return value


# what a path that is not a regular file is, by its stat.S_IS* test
NOT_FILES = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISSOCK, "a socket"),
)


def open_stored(path: Path) -> BinaryIO:
    """`path` open for reading in binary, where it is a regular file (a link to one is
    followed); StoredFileError saying what it is otherwise, FileNotFoundError where
    there is nothing, other OSErrors (a link loop, no permission) as they come. Opened
    without blocking, so a FIFO is refused at once instead of waiting for a writer."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(descriptor).st_mode
        if not stat.S_ISREG(mode):
            what = next((name for test, name in NOT_FILES if test(mode)), "not a file")
            raise StoredFileError(
                path, f"{what}, not a regular file: fedlb reads back only files it wrote"
            )
        os.set_blocking(descriptor, True)
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def read_json(path: Path, *, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The JSON value in `path`: FileNotFoundError where there is none, StoredFileError
    where it is not a regular file (`open_stored`), larger than `max_bytes` or
    `parse_json` refuses it; other OSErrors as they come."""
    with open_stored(path) as file:
        size = os.fstat(file.fileno()).st_size
        if size > max_bytes:
            raise StoredFileError(
                path, f"{size} bytes, more than the {max_bytes} such a file holds"
            )
        data = file.read(max_bytes + 1)  # the file may have grown since
    if len(data) > max_bytes:
        raise StoredFileError(path, f"more than the {max_bytes} bytes such a file holds")
    try:
        return parse_json(data)
    except ValueError as error:
        raise StoredFileError(path, str(error)) from None


def read_json_object(path: Path, *, max_bytes: int = MAX_JSON_BYTES) -> dict[str, Any]:
    """The JSON object in `path`, as `read_json`; StoredFileError where it is not an
    object."""
    value = read_json(path, max_bytes=max_bytes)
    if not isinstance(value, dict):
        raise StoredFileError(path, f"{json_kind(value)}, not a JSON object")
    return value


def read_lines(
    path: Path,
    *,
    max_line_bytes: int = MAX_JSON_LINE_BYTES,
    max_bytes: int = MAX_JSON_LINES_BYTES,
) -> Iterator[tuple[int, bytes]]:
    """(line number, the line's bytes, newline kept) for each non-blank line of `path`,
    read a line at a time; StoredFileError where the file is larger than `max_bytes` or
    a line longer than `max_line_bytes` (naming it), or where it is not a regular file
    (`open_stored`). FileNotFoundError where there is no file."""
    with open_stored(path) as file:
        size = os.fstat(file.fileno()).st_size
        if size > max_bytes:
            raise StoredFileError(
                path, f"{size} bytes, more than the {max_bytes} such a file holds"
            )
        number = 0
        while raw := file.readline(max_line_bytes + 1):
            number += 1
            if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                raise StoredFileError(path, f"longer than {max_line_bytes} bytes", number)
            if raw.strip():
                yield number, raw


def read_json_lines(
    path: Path,
    *,
    max_line_bytes: int = MAX_JSON_LINE_BYTES,
    max_bytes: int = MAX_JSON_LINES_BYTES,
) -> Iterator[tuple[int, str, Any]]:
    """(line number, the line's text, its JSON value) for each non-blank line of `path`
    (`read_lines`' bounds); StoredFileError naming the line where one is not JSON."""
    for number, raw in read_lines(path, max_line_bytes=max_line_bytes, max_bytes=max_bytes):
        try:
            text = raw.decode().rstrip("\n")
            yield number, text, parse_json(text)
        except (UnicodeDecodeError, ValueError) as error:
            raise StoredFileError(path, str(error), number) from None


def set_aside(path: Path) -> Path:
    """Rename a damaged file beside itself (NAME.damaged-YYYYmmdd-HHMMSS[-N]), so a run
    goes on as if it were absent and nothing in it is lost; the new path."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.damaged-{stamp}")
    count = 1
    while target.exists():
        count += 1
        target = path.with_name(f"{path.name}.damaged-{stamp}-{count}")
    os.replace(path, target)
    return target


def json_kind(value: Any) -> str:
    """What a JSON value is, in words."""
    names = {list: "an array", dict: "an object", str: "a string", bool: "true or false"}
    return names.get(type(value), "null" if value is None else "a number")


def _refuse_constant(name: str) -> float:
    raise ValueError(f"not a finite number: {name}")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"not a finite number: {text[:40]}")
    return value


def _short_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"a {len(text.lstrip('-'))}-digit number")
    return int(text)


def _depth(value: Any) -> int:
    """How deep a parsed value nests (a scalar 0), without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, level + 1)
            stack.extend((child, level + 1) for child in item if isinstance(child, dict | list))
    return deepest
