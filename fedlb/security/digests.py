"""Digests beside the models a run stores: `model.pt.sha256` next to `model.pt`.

sha256sum's format, so `sha256sum -c model.pt.sha256` checks a copy anywhere; fedlb
checks it whenever it loads a stored model (`fedlb decrypt`): one flipped bit in a
ciphertext otherwise decrypts, without a word, to weights off by 10^7.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

SUFFIX = ".sha256"


class DigestError(ValueError):
    """A stored file that does not match the digest written beside it."""


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
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
        expected = target.read_text().split()[0]
    except FileNotFoundError:
        return False
    except (OSError, IndexError) as error:
        raise DigestError(f"{target} is unreadable ({error}); cannot check {path}") from error
    if file_digest(path) != expected:
        raise DigestError(
            f"{path} does not match its digest ({target}): the file was damaged or changed "
            "after fedlb wrote it. Use an intact copy (`sha256sum -c` checks one)"
        )
    return True
