"""fedlb.data: dataset loaders and partitioners (numpy only)."""

from .cache import (
    cached_partition,
    dataset_fingerprint,
    partition_cache_dir,
    profile_cache_dir,
    use_profile_dir,
    user_cache_dir,
)
from .digits import load_digits
from .files import load_npz
from .images import (
    load_cifar10,
    load_fashion_mnist,
    load_idx_folder,
)
from .partition import (
    PARTITIONERS,
    describe,
    parse_partition,
    partition,
    partition_by_classes,
    partition_by_id,
    partition_dirichlet,
    server_holdout,
    silo_split,
    split_holdout,
)
from .registry import (
    DATASETS,
    NATURAL_DATASETS,
    Dataset,
    DatasetParts,
    federation_pool,
    load_dataset,
)
from .tabular import load_heart_disease
from .text import load_shakespeare
from .types import LabelledData

__all__ = [
    "DATASETS",
    "NATURAL_DATASETS",
    "PARTITIONERS",
    "Dataset",
    "DatasetParts",
    "LabelledData",
    "cached_partition",
    "dataset_fingerprint",
    "describe",
    "federation_pool",
    "load_cifar10",
    "load_dataset",
    "load_digits",
    "load_fashion_mnist",
    "load_heart_disease",
    "load_idx_folder",
    "load_npz",
    "load_shakespeare",
    "parse_partition",
    "partition",
    "partition_by_classes",
    "partition_by_id",
    "partition_cache_dir",
    "partition_dirichlet",
    "profile_cache_dir",
    "server_holdout",
    "silo_split",
    "split_holdout",
    "use_profile_dir",
    "user_cache_dir",
]
