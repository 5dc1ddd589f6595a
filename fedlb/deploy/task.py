"""What is trained: data, partitions and model from the run's settings (server and silos)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from fedlb.data import (
    DATASETS,
    LabelledData,
    cached_partition,
    dataset_fingerprint,
    federation_pool,
    load_dataset,
    load_npz,
    parse_partition,
    partition,
    silo_split,
    split_holdout,
)
from fedlb.models import build_model

from .run_config import ConfigError, RunConfig


@dataclass(frozen=True)
class SiloData:
    train: LabelledData
    test: LabelledData


def federation_data(config: RunConfig) -> tuple[LabelledData, LabelledData]:
    """(the pool the silos split, the server's test set), the same on every machine."""
    return federation_pool(
        config.dataset, config.data_dir, config.num_silos, config.server_test_fraction, config.seed
    )


def tests_per_group(config: RunConfig) -> bool:
    """Whether each silo tests on its group's own test rows and trains on its whole part
    (a natural partition of a dataset whose groups have test sets: FLamby's centres);
    else a seeded silo-test-fraction of its part is held out. Decided without loading."""
    dataset = DATASETS.get(config.dataset)
    return (
        dataset is not None
        and dataset.group_tests
        and parse_partition(config.partition)[0] == "natural"
    )


def check_partition(config: RunConfig) -> None:
    """Refuse, before anything starts, a dataset that cannot be had here or a split that
    leaves one of the num-silos silos without training samples (ConfigError, naming the
    settings)."""
    what = f"dataset {config.dataset} split {config.partition!r} among num-silos {config.num_silos}"
    try:
        pool, _ = federation_data(config)
        parts = partition(pool.y, config.num_silos, config.partition, config.seed, pool.groups)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{what}: {error}") from error
    trains = [len(part) for part in parts]
    if not tests_per_group(config):  # else every silo trains on its whole part
        for i, part in enumerate(parts):
            keep, _ = split_holdout(len(part), config.silo_test_fraction, config.seed + 1 + i)
            if len(keep) == 0:
                raise ConfigError(
                    f"{what}: silo {i} gets {len(part)} samples and none left to train on "
                    f"after silo-test-fraction {config.silo_test_fraction}; use fewer silos"
                )
            trains[i] = len(keep)
    # A batch draws distinct samples of a silo's part: a B0 above every silo's part only
    # repeats them (and a huge one fills a silo's memory with indices before it fails).
    if config.batch_size > max(trains):
        raise ConfigError(
            f"batch-size {config.batch_size} is more than any silo's training samples ({what}: "
            f"the largest part has {max(trains)}); give batch-size <= {max(trains)}"
        )
    if config.max_batch > sum(trains):
        raise ConfigError(
            f"max-batch {config.max_batch} is more than the federation's training samples "
            f"({sum(trains)}); give max-batch <= {sum(trains)}, or 0 (the balancer's X bounds it)"
        )


def silo_data(config: RunConfig, partition_id: int, num_partitions: int) -> SiloData:
    """One silo's part, from the on-disk partition cache when an earlier process built it
    (every Flower message runs in a fresh process; see fedlb.data.cache)."""
    key = {
        "what": "silo-split",
        "dataset": config.dataset,
        "source": dataset_fingerprint(config.dataset, config.data_dir),
        "num-silos": config.num_silos,  # Shakespeare takes that many roles
        "server-test-fraction": config.server_test_fraction,
        "partition": config.partition,
        "num-partitions": num_partitions,
        "partition-id": partition_id,
        "seed": config.seed,
        "silo-test-fraction": config.silo_test_fraction,
        "silo-tests": "per-group" if tests_per_group(config) else "held-out",
    }

    def build() -> tuple[LabelledData, LabelledData]:
        pool, _ = federation_data(config)
        return silo_split(
            pool,
            partition_id,
            num_partitions,
            config.partition,
            config.seed,
            config.silo_test_fraction,
            load_dataset(config.dataset, config.data_dir, config.num_silos).group_tests
            if tests_per_group(config)
            else None,
        )

    train, test = cached_partition(key, build)
    if len(train) == 0:
        raise ValueError(
            f"silo {partition_id} of {num_partitions} got no training samples with partition "
            f"{config.partition!r}; use fewer partitions"
        )
    return SiloData(train, test)


def model_for(config: RunConfig, data: LabelledData) -> nn.Module:
    return build_model(config.model, tuple(data.x.shape[1:]), data.num_classes, config.seed)


def silo_data_from_file(config: RunConfig, path: str) -> SiloData:
    """A silo's own data (an .npz with arrays x and y) instead of a partition, checked
    against the federation's dataset: the model is shared, so the shapes must agree."""
    own = load_npz(path)
    pool, _ = federation_data(config)
    if tuple(own.x.shape[1:]) != tuple(pool.x.shape[1:]):
        raise ValueError(
            f"{path}: samples have shape {tuple(own.x.shape[1:])}, but the federation's "
            f"model ({config.dataset}) takes {tuple(pool.x.shape[1:])}"
        )
    if own.y.min() < 0 or own.y.max() >= pool.num_classes:
        raise ValueError(
            f"{path}: labels must be in 0..{pool.num_classes - 1} ({config.dataset}), got "
            f"{int(own.y.min())}..{int(own.y.max())}"
        )
    labelled = LabelledData(own.x, own.y, pool.num_classes, own.name)
    keep, held = split_holdout(len(labelled), config.silo_test_fraction, config.seed)
    return SiloData(labelled.subset(keep), labelled.subset(held))
