"""A silo's (train, test) partition kept on disk, so the next process reuses it.

In a Flower deployment every message starts a fresh `flwr-clientapp` process; without this,
each one reloads the whole dataset (Fashion-MNIST: decompress 60,000 images), holds out the
server's test set and partitions it again, only to keep one silo's part. Here the part is
built once and stored as an uncompressed .npz named by the sha256 of everything that
defines it (the caller's key, plus this format's version, numpy's version and the source of
fedlb.data, since a changed partitioner or RNG would give different parts); the next process
reads it back.

Where: $FEDLB_CACHE_DIR, else $XDG_CACHE_HOME/fedlb/partitions, else
~/.cache/fedlb/partitions; an empty FEDLB_CACHE_DIR counts as unset, and
FEDLB_CACHE_DIR=off turns caching off. The folder is kept under $FEDLB_CACHE_MAX_MB
(default 2048 MiB) by deleting the oldest entries after each write; deleting the folder
clears it. An entry is written to a temporary file in the same folder and renamed into
place, so racing silo processes never read half a file; an unreadable entry is rebuilt
with a warning, and a folder that cannot be written only costs the rebuild.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
import time
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .registry import DATASETS
from .types import LabelledData

log = logging.getLogger("fedlb.data")

FORMAT_VERSION = 1
ENV_DIR = "FEDLB_CACHE_DIR"
ENV_MAX_MB = "FEDLB_CACHE_MAX_MB"
OFF = "off"
PROFILE_ENV_DIR = "FEDLB_PROFILE_DIR"  # fedlb.flower.profiles's folder
DEFAULT_MAX_MB = 2048
PREFIX = "partition-"
Split = tuple[LabelledData, LabelledData]


def user_cache_dir(env: str, leaf: str) -> Path | None:
    """A fedlb cache folder: $`env`, else $XDG_CACHE_HOME/fedlb/`leaf`, else
    ~/.cache/fedlb/`leaf`; None when $`env` is "off" (an empty one counts as unset)."""
    chosen = os.environ.get(env, "")
    if chosen.strip().lower() == OFF:
        return None
    if chosen:
        return Path(chosen).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "fedlb" / leaf


# use_profile_dir's folder for this process ('': none), over $FEDLB_PROFILE_DIR; not the
# environment itself: setenv in a running process races the getenv of its other threads
# (torch's, Ray's), and a simulated server crashed in getenv that way
_profile_dir: str | None = None


def profile_cache_dir() -> Path | None:
    """Where silos keep their speed profiles and servers their guard verdicts
    (fedlb.flower.profiles); None when FEDLB_PROFILE_DIR=off (or `use_profile_dir('')`)."""
    if _profile_dir is not None:
        return Path(_profile_dir) if _profile_dir else None
    return user_cache_dir(PROFILE_ENV_DIR, "profiles")


def use_profile_dir(folder: str) -> None:
    """This process's profiles and verdicts in `folder` from now on ('': none, off),
    whatever $FEDLB_PROFILE_DIR says (an experiment points a reused process at each run's
    folder)."""
    global _profile_dir
    _profile_dir = folder


def partition_cache_dir() -> Path | None:
    """The folder entries go to, from the environment; None when FEDLB_CACHE_DIR=off."""
    return user_cache_dir(ENV_DIR, "partitions")


def dataset_fingerprint(name: str, data_dir: str | Path = "") -> dict[str, Any]:
    """The identity of a dataset's files: the resolved path (data_dir, or the dataset's
    default place) and a digest of (relative path, size, mtime) of every file under it, so
    a replaced or touched file gives a different cache key. Cheap: stats, no reads."""
    if str(data_dir):
        source: Path | None = Path(data_dir).expanduser()
    else:
        source = DATASETS[name].default_source() if name in DATASETS else None
    if source is None:
        return {"path": "", "files": ""}
    source = source.resolve()
    if source.is_file():
        files = [source]
    elif source.is_dir():
        files = sorted(p for p in source.rglob("*") if p.is_file())
    else:
        return {"path": str(source), "files": "missing"}
    listing = hashlib.sha256()
    for path in files:
        stat = path.stat()
        relative = path.relative_to(source).as_posix() if path != source else path.name
        listing.update(f"{relative}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return {"path": str(source), "files": f"{len(files)}:{listing.hexdigest()}"}


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    # The partitioners and loaders themselves: an edited fedlb.data must not serve old parts.
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def entry_key(key: Mapping[str, Any]) -> dict[str, Any]:
    """The caller's key with what the cache adds to it (format, numpy, fedlb.data's code)."""
    return {
        **key,
        "cache-format": FORMAT_VERSION,
        "numpy": np.__version__,
        "fedlb-data-code": _code_digest(),
    }


def _canonical(key: Mapping[str, Any]) -> str:
    return json.dumps(entry_key(key), sort_keys=True, separators=(",", ":"))


def entry_path(folder: Path, key: Mapping[str, Any]) -> Path:
    """The file of `key` (a JSON-able mapping) in `folder`: sha256 of its canonical JSON."""
    return _path(folder, _canonical(key))


def _path(folder: Path, canonical: str) -> Path:
    return folder / f"{PREFIX}{hashlib.sha256(canonical.encode()).hexdigest()}.npz"


def _arrays(prefix: str, data: LabelledData) -> dict[str, np.ndarray]:
    arrays = {f"{prefix}_x": data.x, f"{prefix}_y": data.y}
    if data.groups is not None:
        arrays[f"{prefix}_groups"] = data.groups
    return arrays


def _read(path: Path, canonical: str) -> Split:
    with np.load(path, allow_pickle=False) as raw:
        if str(raw["key"]) != canonical:
            raise ValueError("stored key differs (a hash collision or a foreign file)")
        num_classes, name = int(raw["num_classes"]), str(raw["name"])
        parts = []
        for prefix in ("train", "test"):
            groups = raw[f"{prefix}_groups"] if f"{prefix}_groups" in raw.files else None
            parts.append(
                LabelledData(raw[f"{prefix}_x"], raw[f"{prefix}_y"], num_classes, name, groups)
            )
    return parts[0], parts[1]


def _write(path: Path, canonical: str, train: LabelledData, test: LabelledData) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)  # copies of private data
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".npz")
    try:
        with os.fdopen(descriptor, "wb") as handle:
            np.savez(
                handle,
                allow_pickle=False,  # object arrays could not be read back without pickle
                key=np.array(canonical),
                num_classes=np.array(train.num_classes),
                name=np.array(train.name),
                **_arrays("train", train),
                **_arrays("test", test),
            )
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _max_bytes() -> int:
    try:
        return int(float(os.environ.get(ENV_MAX_MB, DEFAULT_MAX_MB)) * 2**20)
    except ValueError:
        log.warning(
            "%s=%r is not a number; using %d", ENV_MAX_MB, os.environ[ENV_MAX_MB], DEFAULT_MAX_MB
        )
        return DEFAULT_MAX_MB * 2**20


def _evict(folder: Path, keep: Path, max_bytes: int) -> None:
    """Delete the oldest-written entries (not `keep`) until the folder fits in max_bytes,
    and temporaries left by writers that died an hour ago or more."""
    entries = []
    for path in folder.glob(f"{PREFIX}*.npz"):
        try:
            stat = path.stat()
        except FileNotFoundError:  # another process evicted it
            continue
        entries.append((stat.st_mtime_ns, stat.st_size, path))
    stale = time.time() - 3600  # temporaries of writers killed mid-write
    for path in folder.glob(".tmp-*.npz"):
        try:
            if path.stat().st_mtime < stale:
                path.unlink()
        except FileNotFoundError:
            continue
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= max_bytes:
            break
        if path != keep:
            path.unlink(missing_ok=True)
            total -= size


def cached_partition(
    key: Mapping[str, Any], build: Callable[[], Split], folder: Path | None = None
) -> Split:
    """build() 's (train, test), read from the cache when an entry for `key` exists, else
    built and stored. `key` must be a JSON-able mapping naming everything the result
    depends on (dataset_fingerprint(...) for the source files); `folder`: the cache folder
    (default partition_cache_dir(); no caching when that is None). Never fails because of
    the cache: unreadable entries are rebuilt, unwritable folders only skip the store."""
    folder = folder if folder is not None else partition_cache_dir()
    if folder is None:
        return build()
    canonical = _canonical(key)
    path = _path(folder, canonical)
    try:
        train, test = _read(path, canonical)
        log.debug("partition from cache %s", path)
        return train, test
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
        log.warning("partition cache entry %s is unreadable (%s); rebuilding it", path, error)
    train, test = build()
    try:
        _write(path, canonical, train, test)
        _evict(folder, path, _max_bytes())
        log.debug("partition built and cached at %s", path)
    except (OSError, ValueError) as error:
        log.warning("partition cache: could not store %s (%s); going on without", path, error)
    return train, test
