"""fedlb.data: dataset loaders and partitioners (numpy only)."""

from .digits import load_digits
from .files import load_npz
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
    "load_npz",
    "partition",
    "partition_by_classes",
    "partition_iid",
    "server_holdout",
    "silo_split",
    "split_holdout",
]
