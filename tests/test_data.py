"""Datasets and partitions."""

from __future__ import annotations

import re

import numpy as np
import pytest

from fedlb.data import (
    load_digits,
    load_npz,
    partition,
    partition_by_classes,
    server_holdout,
    silo_split,
)


def test_digits_are_embedded_and_complete():
    digits = load_digits()
    assert digits.x.shape == (1797, 1, 8, 8)
    assert digits.x.dtype == np.float32
    assert digits.x.min() >= 0.0
    assert digits.x.max() <= 1.0
    assert sum(digits.class_counts()) == 1797
    assert len(digits.class_counts()) == 10


def test_two_classes_per_silo_is_the_papers_split():
    labels = load_digits().y
    parts = partition_by_classes(labels, 5, 2, seed=0)
    for i, part in enumerate(parts):
        assert set(np.unique(labels[part])) == {2 * i, 2 * i + 1}
    assert sum(len(p) for p in parts) == len(labels)


@pytest.mark.parametrize("scheme", ["iid", "classes:2", "classes:3"])
def test_partitions_are_disjoint_seeded_and_cover(scheme):
    labels = load_digits().y
    a = partition(labels, 4, scheme, seed=3)
    b = partition(labels, 4, scheme, seed=3)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    joined = np.concatenate(a)
    assert len(joined) == len(set(joined.tolist()))
    if scheme == "iid":
        assert len(joined) == len(labels)


@pytest.mark.parametrize(
    ("scheme", "message"),
    [
        ("dirichlet", "unknown partition"),
        ("classes:x", "must be an integer"),
        ("classes:11", "classes_per_silo must be in"),
    ],
)
def test_bad_partitions_are_refused(scheme, message):
    with pytest.raises(ValueError, match=message):
        partition(load_digits().y, 3, scheme, seed=0)


def test_silo_and_server_splits_do_not_overlap():
    digits = load_digits()
    pool, server_test = server_holdout(digits, 0.2, seed=0)
    assert len(server_test) == round(1797 * 0.2)
    train, test = silo_split(pool, 1, 3, "iid", seed=0, test_fraction=0.25)
    assert len(test) == round((len(train) + len(test)) * 0.25)
    with pytest.raises(ValueError, match=r"outside 0\.\.2"):
        silo_split(pool, 3, 3, "iid", seed=0)


def test_npz_files_are_read_and_bad_ones_explained(tmp_path):
    good = tmp_path / "good.npz"
    np.savez(good, x=np.ones((4, 2)), y=np.array([0, 1, 2, 1]))
    data = load_npz(good)
    assert data.x.dtype == np.float32
    assert data.num_classes == 3
    cases = {
        "missing.npz": (None, "no such data file"),
        "text.npz": (b"hello", "not a readable .npz file"),
        "nokeys.npz": ({"a": np.ones(3)}, "needs arrays x (samples) and y (labels)"),
        "lengths.npz": ({"x": np.ones((3, 2)), "y": np.ones(2)}, "3 samples and 2 labels"),
        "fractional.npz": ({"x": np.ones((2, 2)), "y": np.array([0.5, 1])}, "whole-number"),
        # what a silo's first message used to find (issue 35): now found when it starts
        "zero-bytes.npz": (b"", "not a readable .npz file"),
        "cut.npz": (good.read_bytes()[:100], "not a readable .npz file"),
        "empty.npz": ({"x": np.ones((0, 2)), "y": np.ones(0)}, "holds no samples"),
        "scalar.npz": ({"x": 1.0, "y": 0}, "x is not an array with one row per sample"),
        "strings.npz": ({"x": np.array(["a", "b"]), "y": np.ones(2)}, "x holds text values"),
        "objects.npz": ({"x": np.array([1, None]), "y": np.ones(2)}, "x or y cannot be read"),
        "nan.npz": ({"x": np.array([[np.nan], [1]]), "y": np.ones(2)}, "NaN or infinite"),
        "negative.npz": ({"x": np.ones((2, 2)), "y": np.array([0, -1])}, "negative label"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif isinstance(content, dict):
            np.savez(path, **content)
        with pytest.raises((ValueError, FileNotFoundError), match=re.escape(message)):
            load_npz(path)


def test_dirichlet_partitions_skew_labels_more_as_alpha_falls():
    labels = load_digits().y

    def skew(alpha):
        parts = partition(labels, 5, f"dirichlet:{alpha}", seed=1)
        assert sum(len(p) for p in parts) == len(labels)
        assert min(len(p) for p in parts) >= 2
        shares = [np.bincount(labels[p], minlength=10).max() / len(p) for p in parts]
        return float(np.mean(shares))

    assert skew(0.1) > skew(1.0) > skew(100.0)
    assert skew(100.0) < 0.2  # close to IID: the top class near 1/10


def test_natural_partition_and_summary():
    from fedlb.data import describe, partition_by_id

    ids = np.array(["cleveland", "va", "cleveland", "hungary", "va"])
    parts = partition_by_id(ids)
    assert {k: v.tolist() for k, v in parts.items()} == {
        "cleveland": [0, 2],
        "hungary": [3],
        "va": [1, 4],
    }
    labels = np.array([0, 1, 1, 0, 1])
    summary = describe(labels, list(parts.values()), 2)
    assert summary[0] == {"silo": 0, "samples": 2, "classes": [1, 1]}
