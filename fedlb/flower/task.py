"""What is trained: data, partitions and model from the run's settings (server and silos)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from fedlb.data import LabelledData, load_digits, server_holdout, silo_split
from fedlb.models import build_model

from .config import RunConfig

LOADERS = {"digits": load_digits}


@dataclass(frozen=True)
class SiloData:
    train: LabelledData
    test: LabelledData


def federation_data(config: RunConfig) -> tuple[LabelledData, LabelledData]:
    """(the pool the silos split, the server's test set), the same on every machine."""
    data = LOADERS[config.dataset]()
    return server_holdout(data, config.server_test_fraction, config.seed)


def silo_data(config: RunConfig, partition_id: int, num_partitions: int) -> SiloData:
    pool, _ = federation_data(config)
    train, test = silo_split(
        pool,
        partition_id,
        num_partitions,
        config.partition,
        config.seed,
        config.silo_test_fraction,
    )
    if len(train) == 0:
        raise ValueError(
            f"silo {partition_id} of {num_partitions} got no training samples with partition "
            f"{config.partition!r}; use fewer partitions"
        )
    return SiloData(train, test)


def model_for(config: RunConfig, data: LabelledData) -> nn.Module:
    return build_model(config.model, tuple(data.x.shape[1:]), data.num_classes, config.seed)
