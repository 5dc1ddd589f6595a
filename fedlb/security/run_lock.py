"""One fedlb run per folder at a time: an OS lock on a file inside the folder.

Every command that writes a folder (a server's out-dir, an experiment's, a silo's work
dir) holds it while it runs. The lock is the kernel's (flock on `folder/.fedlb.lock`): it
goes when the process ends, however it ends, so a killed run leaves nothing that blocks
the next one. The file stays, naming its last holder; it is no result of a run.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shlex
import sys
import threading
import time
import unicodedata
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

from .stored import read_json

LOCK_FILE = ".fedlb.lock"  # in the folder; never part of a run's results
HOLDER_WRITTEN_S = 2.0  # how long a refused start waits for the holder to name itself
COMMAND_CHARS = 120  # of the holder's command line in the refusal
HOLDER_BYTES = 4096  # what a holder writes: its pid, command line and start

_held: dict[Path, tuple[int, bool, int]] = {}  # folder -> (lock descriptor, made, claims)
_guard = threading.Lock()


class FolderInUseError(Exception):
    """Another process holds the folder: the message names it and what to do."""


@contextlib.contextmanager
def claim_folder(folder: Path) -> Iterator[Path]:
    """Hold `folder` (made if missing) for this process while the block runs;
    FolderInUseError at once when another process holds it. Take it before looking at
    what the folder holds, so two starts cannot both find it free. Claims of one folder
    nest within a process (a command, then the library function it calls). A folder the
    claim made goes again if nothing but the lock was put in it. Yields the folder,
    resolved."""
    folder = folder.resolve()
    with _guard:
        descriptor, made, claims = _held.get(folder) or (*_lock(folder), 0)
        _held[folder] = (descriptor, made, claims + 1)
    try:
        yield folder
    finally:
        with _guard:
            descriptor, made, claims = _held.pop(folder)
            if claims > 1:
                _held[folder] = (descriptor, made, claims - 1)
            else:
                _release(folder, descriptor, made)


def _lock(folder: Path) -> tuple[int, bool]:
    """The folder's lock taken: its descriptor, and whether the folder was made for it."""
    made = not folder.exists()
    while True:
        folder.mkdir(parents=True, exist_ok=True)
        try:
            descriptor = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:  # the folder went with a holder that left it empty
            continue
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(descriptor)
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise FolderInUseError(refusal(folder)) from None
        try:  # a holder that left removes an empty folder's lock file: is this one still it?
            current = os.stat(folder / LOCK_FILE).st_ino == os.fstat(descriptor).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(descriptor)
    holder = {
        "pid": os.getpid(),
        "command": command_line(),
        "started": datetime.now().strftime("%Y-%m-%d %H:%M:%S"),
    }
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, json.dumps(holder).encode(), 0)
    return descriptor, made


def _release(folder: Path, descriptor: int, made: bool) -> None:
    """Let the folder go; one made for the claim goes too while it holds only the lock (a
    run refused before it wrote anything leaves nothing behind)."""
    try:
        with contextlib.suppress(OSError):
            if made and os.listdir(folder) == [LOCK_FILE]:
                os.unlink(folder / LOCK_FILE)  # still held: no one takes it meanwhile
                folder.rmdir()
    finally:
        os.close(descriptor)  # the lock goes with it


def command_line() -> str:
    """This process's command as its user typed it (`fedlb experiment --out x`), cut short
    on whole arguments (`cut_command`)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)  # python -m fedlb.cli
    first = sys.argv[0] if sys.argv else ""
    if spec is not None:
        program = ["python", "-m", spec.name.removesuffix(".__main__")]
    else:  # a command (fedlb, pytest), a script, python -c
        program = ["python", "-c"] if first == "-c" else [Path(first).name or "python"]
    return cut_command([*program, *sys.argv[1:]])


def cut_command(arguments: list[str], limit: int = COMMAND_CHARS) -> str:
    """`arguments` quoted as a shell would take them, at most `limit` characters: cut
    between whole arguments, " ..." where it is; a first argument longer than that alone
    is cut between whole characters (a letter and its accents kept together). Each
    argument is read as UTF-8 from the bytes the OS gave (U+FFFD where they are not)."""
    shown = [_printable(argument) for argument in arguments]
    line = shlex.join(shown)
    if len(line) <= limit:
        return line
    kept = ""
    for argument in shown:
        quoted = shlex.quote(argument)
        more = f"{kept} {quoted}" if kept else quoted
        if len(more) > limit - 4:
            break
        kept = more
    if not kept:  # the first argument alone is too long: its first characters
        kept = shlex.quote(_characters(shown[0], limit - 6))
    return f"{kept} ..."


def _printable(argument: str) -> str:
    """An argument as the user typed it: its bytes as the OS gave them, read as UTF-8
    (U+FFFD where they are not), whatever the locale decoded them as."""
    return os.fsencode(argument).decode("utf-8", "replace")


def _characters(text: str, limit: int) -> str:
    """The first characters of `text`, at most `limit` of them, not parting a base
    character from the combining marks after it."""
    cut = min(limit, len(text))
    while 0 < cut < len(text) and unicodedata.combining(text[cut]):
        cut -= 1
    return text[:cut]


def refusal(folder: Path) -> str:
    """The line that refuses a start into `folder`, naming who holds it."""
    holder = _holder(folder / LOCK_FILE)
    command = str(holder["command"]) if holder else ""
    if len(command) > COMMAND_CHARS:  # another fedlb's, or written by hand: cut here too
        command = _characters(command, COMMAND_CHARS - 4) + " ..."
    who = (
        f"pid {holder['pid']}, `{command}` started at {holder['started']}"
        if holder
        else "it has not named itself yet"
    )
    return (
        f"{folder} is in use by another fedlb run ({who}): wait for it to end or give "
        "another folder"
    )


def _holder(path: Path) -> dict[str, object] | None:
    """What the holder wrote in the lock file. It writes just after it takes the lock, over
    what an earlier holder wrote: a start refused in that instant reads again a moment."""
    deadline = time.monotonic() + HOLDER_WRITTEN_S
    while True:
        with contextlib.suppress(OSError, ValueError):  # StoredFileError too: read again
            holder = read_json(path, max_bytes=HOLDER_BYTES)
            if (
                isinstance(holder, dict)
                and {"pid", "command", "started"} <= set(holder)
                and isinstance(holder["pid"], int)
                and _alive(holder["pid"])
            ):
                return holder
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    if not 0 < pid < 2**31:  # 0 and below are process groups to os.kill
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True
