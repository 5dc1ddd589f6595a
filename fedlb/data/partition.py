"""Splitting one dataset among silos, and each silo's part into train and held-out test.

Every function is seeded and deterministic: the same (labels, silos, seed) gives the same
partition on every silo machine, so each silo can compute its own part independently.
"""

from __future__ import annotations

import numpy as np

from .types import LabelledData


def split_holdout(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Shuffled indices 0..n-1 split into (kept, held out), `fraction` held out."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"held-out fraction must be in [0, 1), got {fraction}")
    order = np.random.default_rng(seed).permutation(n)
    cut = round(n * fraction)
    return np.sort(order[cut:]), np.sort(order[:cut])


def partition_iid(labels: np.ndarray, num_silos: int, seed: int) -> list[np.ndarray]:
    """Shuffle and deal the samples out in nearly equal parts."""
    _check(len(labels), num_silos)
    order = np.random.default_rng(seed).permutation(len(labels))
    return [np.sort(part) for part in np.array_split(order, num_silos)]


def partition_by_classes(
    labels: np.ndarray, num_silos: int, classes_per_silo: int, seed: int
) -> list[np.ndarray]:
    """Pathological non-IID: every silo holds exactly `classes_per_silo` classes.

    Silo i gets classes (i·k + j) mod C for j < k (k = classes_per_silo, C = classes
    present), so with 5 silos, 10 classes and k = 2 (the LB-BSP paper's split) silo i holds
    classes 2i and 2i+1 and nothing else. Each class is divided evenly, at random, among the
    silos that hold it; classes no silo holds are left out.
    """
    _check(len(labels), num_silos)
    classes = np.unique(labels)
    if not 1 <= classes_per_silo <= len(classes):
        raise ValueError(
            f"classes_per_silo must be in [1, {len(classes)}] (classes present), "
            f"got {classes_per_silo}"
        )
    holders: dict[int, list[int]] = {int(c): [] for c in classes}
    for silo in range(num_silos):
        for j in range(classes_per_silo):
            holders[int(classes[(silo * classes_per_silo + j) % len(classes)])].append(silo)
    rng = np.random.default_rng(seed)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_silos)]
    for c, silos in holders.items():
        if not silos:
            continue
        members = rng.permutation(np.flatnonzero(labels == c))
        for silo, chunk in zip(silos, np.array_split(members, len(silos)), strict=True):
            parts[silo].append(chunk)
    result = [np.sort(np.concatenate(p)) if p else np.array([], dtype=np.int64) for p in parts]
    empty = [i for i, p in enumerate(result) if len(p) == 0]
    if empty:
        raise ValueError(f"silos {empty} received no samples: use fewer silos or more classes")
    return result


def partition_dirichlet(
    labels: np.ndarray, num_silos: int, alpha: float, seed: int, min_size: int = 2
) -> list[np.ndarray]:
    """Label skew by Dirichlet(α): for every class, the shares of its samples per silo are
    drawn from Dir(α, ..., α); small α gives each silo few dominant classes, large α tends
    to IID. Redrawn (seeded) until every silo has at least `min_size` samples."""
    _check(len(labels), num_silos)
    if not (np.isfinite(alpha) and alpha > 0):
        raise ValueError(f"Dirichlet alpha must be > 0, got {alpha}")
    if len(labels) < num_silos * min_size:
        raise ValueError(f"{len(labels)} samples cannot give {num_silos} silos {min_size} each")
    rng = np.random.default_rng(seed)
    for _ in range(1000):
        parts: list[list[int]] = [[] for _ in range(num_silos)]
        for c in np.unique(labels):
            members = rng.permutation(np.flatnonzero(labels == c))
            shares = rng.dirichlet(np.full(num_silos, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(members)).astype(int)
            for silo, chunk in enumerate(np.split(members, cuts)):
                parts[silo].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.sort(np.array(p, dtype=np.int64)) for p in parts]
    raise ValueError(
        f"Dirichlet({alpha}) left a silo with fewer than {min_size} samples in 1000 draws: "
        "raise alpha or use fewer silos"
    )


def partition_by_id(ids: np.ndarray) -> dict[str, np.ndarray]:
    """Natural partition: one part per distinct id (a speaking role, a hospital)."""
    return {str(value): np.flatnonzero(ids == value) for value in np.unique(ids)}


def describe(
    labels: np.ndarray, parts: list[np.ndarray], num_classes: int
) -> list[dict[str, object]]:
    """Per silo: how many samples, and how many of each class (for a run's output)."""
    return [
        {
            "silo": i,
            "samples": len(part),
            "classes": np.bincount(labels[part], minlength=num_classes).tolist(),
        }
        for i, part in enumerate(parts)
    ]


# Partition specs by name: those of flwr-datasets' partitioners are accepted too.
PARTITIONERS = {
    "iid": "uniformly at random, equal shares (flwr-datasets: IidPartitioner)",
    "classes:K": "K classes per silo, the LB-BSP paper's split",
    "pathological:K": "the same as classes:K under flwr-datasets' name (PathologicalPartitioner)",
    "dirichlet:α": "each class spread over the silos by Dirichlet(α) (DirichletPartitioner)",
    "natural": "one silo per natural group: hospital, speaker (NaturalIdPartitioner)",
}
ALIASES = {"pathological": "classes"}


def parse_partition(spec: str) -> tuple[str, float | None]:
    """('iid' | 'classes' | 'dirichlet' | 'natural', its parameter) of a partition spec,
    or a ValueError that lists the accepted ones."""
    kind, _, argument = spec.partition(":")
    kind = ALIASES.get(kind, kind)
    if kind in ("iid", "natural") and not argument:
        return kind, None
    if kind == "classes" and argument:
        try:
            return kind, int(argument)
        except ValueError as error:
            raise ValueError(f"partition {spec!r}: K in 'classes:K' must be an integer") from error
    if kind == "dirichlet" and argument:
        try:
            return kind, float(argument)
        except ValueError as error:
            raise ValueError(f"partition {spec!r}: α must be a number") from error
    raise ValueError(
        f"unknown partition {spec!r}: use 'iid', 'classes:K' (e.g. classes:2, also "
        "pathological:K), 'dirichlet:α' (e.g. dirichlet:0.5) or 'natural'"
    )


def partition(
    labels: np.ndarray,
    num_silos: int,
    scheme: str,
    seed: int,
    groups: np.ndarray | None = None,
) -> list[np.ndarray]:
    """By name (PARTITIONERS): 'iid', 'classes:K' (K classes per silo), 'dirichlet:α', or
    'natural' (one silo per group — hospital, speaker — in sorted order; needs `groups`)."""
    kind, argument = parse_partition(scheme)
    if kind == "natural":
        if groups is None:
            raise ValueError("partition 'natural' needs a dataset with natural groups")
        parts = partition_by_id(groups)
        if len(parts) != num_silos:
            raise ValueError(
                f"partition 'natural' gives {len(parts)} silos ({', '.join(parts)}), "
                f"not {num_silos}"
            )
        return [parts[key] for key in sorted(parts)]
    if kind == "dirichlet":
        assert argument is not None
        return partition_dirichlet(labels, num_silos, argument, seed)
    if kind == "classes":
        assert argument is not None
        return partition_by_classes(labels, num_silos, int(argument), seed)
    return partition_iid(labels, num_silos, seed)


def server_holdout(
    data: LabelledData, fraction: float, seed: int
) -> tuple[LabelledData, LabelledData]:
    """(pool the silos partition, the server's test set). fraction 0: no server test set."""
    keep, held = split_holdout(len(data), fraction, seed)
    return data.subset(keep), data.subset(held)


def silo_split(
    data: LabelledData,
    partition_id: int,
    num_partitions: int,
    scheme: str,
    seed: int,
    test_fraction: float = 0.2,
    group_tests: LabelledData | None = None,
) -> tuple[LabelledData, LabelledData]:
    """One silo's (train, test) part of `data`: a seeded `test_fraction` of its part held
    out; or, under 'natural' with `group_tests` (test rows that carry their group, as
    FLamby's centres have), its whole part to train on and its group's rows to test on."""
    if not 0 <= partition_id < num_partitions:
        raise ValueError(
            f"partition-id {partition_id} is outside 0..{num_partitions - 1} (num-partitions)"
        )
    part = partition(data.y, num_partitions, scheme, seed, data.groups)[partition_id]
    if group_tests is not None and parse_partition(scheme)[0] == "natural":
        if data.groups is None or group_tests.groups is None:
            raise ValueError(f"{group_tests.name}: test rows without their groups")
        group = data.groups[part[0]]
        return data.subset(part), group_tests.subset(np.flatnonzero(group_tests.groups == group))
    keep, held = split_holdout(len(part), test_fraction, seed + 1 + partition_id)
    return data.subset(part[keep]), data.subset(part[held])


def _check(n: int, num_silos: int) -> None:
    if num_silos < 1:
        raise ValueError(f"the number of silos must be >= 1, got {num_silos}")
    if n < num_silos:
        raise ValueError(f"{n} samples cannot be split among {num_silos} silos")
