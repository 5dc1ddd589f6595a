"""scikit-learn's digits, embedded: the default dataset of fedlb's first runs.

1,797 8x8 grey images of handwritten digits, 10 classes, pixel values 0..16. The arrays in
digits.npz were written from `sklearn.datasets.load_digits()` (scikit-learn 1.9.1, BSD-3;
the data is the test part of the UCI Optical Recognition of Handwritten Digits set,
CC BY 4.0), so fedlb needs neither scikit-learn nor a download to run.
"""

from __future__ import annotations

from importlib.resources import files

import numpy as np

from .types import LabelledData

NUM_CLASSES = 10


def load_digits() -> LabelledData:
    """All 1,797 digits: x float32 (n, 1, 8, 8) scaled to [0, 1], y int64 labels."""
    with files("fedlb.data").joinpath("digits.npz").open("rb") as handle, np.load(handle) as raw:
        images, labels = raw["images"], raw["labels"]
    x = (images.astype(np.float32) / 16.0)[:, None, :, :]
    return LabelledData(x=x, y=labels.astype(np.int64), num_classes=NUM_CLASSES, name="digits")
