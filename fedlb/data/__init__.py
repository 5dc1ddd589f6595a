"""fedlb.data: dataset loaders and partitioners (numpy only)."""

from .digits import load_digits
from .partition import (
    partition,
    partition_by_classes,
    partition_iid,
    server_holdout,
    silo_split,
    split_holdout,
)
from .types import LabelledData

__all__ = [
    "LabelledData",
    "load_digits",
    "partition",
    "partition_by_classes",
    "partition_iid",
    "server_holdout",
    "silo_split",
    "split_holdout",
]
