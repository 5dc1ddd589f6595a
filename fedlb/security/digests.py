"""Digests of the files a run stores: beside them, and sealed inside the zips fedlb reads back.

Beside: `model.pt.sha256` next to `model.pt`, sha256sum's format, so `sha256sum -c
model.pt.sha256` checks a copy anywhere; fedlb checks it whenever it loads a stored model
(`fedlb decrypt`): one flipped bit in a ciphertext otherwise decrypts, without a word, to
weights off by 10^7.

Inside: a side file gets lost when a file is copied alone, so every zip that fedlb writes
and later trusts (an .npz: model.ckks.npz, checkpoint.npz) carries its own digest as the
zip's archive comment, the file's last bytes: `fedlb-sha256:` and the hex sha256 of every
byte before it (the end-of-central-directory record included, its comment length set to
the seal's in advance). numpy, torch and zipfile read such a file as any zip; `check_seal`
checks all of it, zip headers and central directory as much as the arrays, before anything
in it is read.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import BinaryIO

from .stored import StoredFileError, open_stored

SUFFIX = ".sha256"

SEAL_PREFIX = b"fedlb-sha256:"
SEAL_SIZE = len(SEAL_PREFIX) + 64  # the archive comment: prefix and 64 hex digits
_SEAL = re.compile(rb"fedlb-sha256:([0-9a-f]{64})\Z")
_END_RECORD = b"PK\x05\x06"  # a zip's end-of-central-directory record, 22 bytes unless
_END_SIZE = 22  # a comment follows it (its last two bytes: the comment's length)
_BLOCK = 1 << 20


class DigestError(ValueError):
    """A stored file that does not match its digest (beside it or inside it), or that was
    cut short or added to."""


def _hash(handle: BinaryIO, size: int) -> str:
    """The hex sha256 of the first `size` bytes from the handle's position."""
    digest = hashlib.sha256()
    while size > 0:
        block = handle.read(min(_BLOCK, size))
        if not block:
            break  # shorter than said: the caller's comparison fails
        digest.update(block)
        size -= len(block)
    return digest.hexdigest()


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open_stored(path) as handle:
        for block in iter(lambda: handle.read(_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def digest_path(path: Path) -> Path:
    return path.with_name(path.name + SUFFIX)


def write_digest(path: Path) -> Path:
    """Write `path`'s digest beside it (atomically); the digest file's path."""
    target = digest_path(path)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    temporary.write_text(f"{file_digest(path)}  {path.name}\n")
    os.replace(temporary, target)
    return target


def check_digest(path: Path) -> bool:
    """Check `path` against the digest beside it: True when it matches, False when there
    is none (written by something else than fedlb); DigestError when it does not match."""
    target = digest_path(path)
    try:
        with open_stored(target) as handle:  # a FIFO in its place must not hang the check
            expected = handle.read(4096).decode(errors="replace").split()[0]
    except FileNotFoundError:
        return False
    except (OSError, IndexError, StoredFileError) as error:
        raise DigestError(f"{target} is unreadable ({error}); cannot check {path}") from error
    if file_digest(path) != expected:
        raise DigestError(
            f"{path} does not match its digest ({target}): the file was damaged or changed "
            "after fedlb wrote it. Use an intact copy (`sha256sum -c` checks one)"
        )
    return True


def seal_zip(handle: BinaryIO) -> None:
    """Seal the zip just written to `handle` (open for reading and writing, a zip without
    a comment, as np.savez and torch.save write one): its digest becomes its archive
    comment, appended at its end. ValueError if it does not end as such a zip does."""
    size = handle.seek(0, os.SEEK_END)
    handle.seek(max(0, size - _END_SIZE))
    end = handle.read(_END_SIZE)
    if len(end) != _END_SIZE or end[:4] != _END_RECORD or end[-2:] != b"\0\0":
        raise ValueError("not a zip without an archive comment: cannot seal it")
    handle.seek(size - 2)
    handle.write(SEAL_SIZE.to_bytes(2, "little"))  # the comment's length, hashed with the rest
    handle.seek(0)
    seal = SEAL_PREFIX + _hash(handle, size).encode()
    handle.seek(size)
    handle.write(seal)
    handle.flush()


def check_seal(path: Path) -> bool:
    """Check the zip at `path` against the digest sealed in it (`seal_zip`), before anything
    in it is read: True when it matches; False for a zip that ends without any comment
    (written before fedlb sealed its files); DigestError, naming the file, for anything
    else: one changed byte anywhere, a file cut short or with bytes added at its end.
    StoredFileError where `path` is not a regular file (a FIFO, a device)."""
    with open_stored(path) as handle:
        size = handle.seek(0, os.SEEK_END)
        handle.seek(max(0, size - SEAL_SIZE))
        tail = handle.read()
        found = _SEAL.match(tail)
        if found is not None:
            handle.seek(0)
            if _hash(handle, size - SEAL_SIZE) != found.group(1).decode():
                raise DigestError(
                    f"{path} is damaged: its bytes do not match the digest fedlb sealed at its "
                    "end (changed after fedlb wrote it)"
                )
            return True
        handle.seek(max(0, size - _END_SIZE))
        end = handle.read()
    if len(end) == _END_SIZE and end[:4] == _END_RECORD and end[-2:] == b"\0\0":
        return False
    raise DigestError(
        f"{path} is damaged, or not a file fedlb wrote: it ends in neither fedlb's digest "
        f"nor a zip's end record ({size} bytes: cut short, or bytes changed or added at its "
        "end)"
    )
