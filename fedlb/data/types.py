"""The one shape every loader returns."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LabelledData:
    """Samples x (first axis indexes samples) and integer labels y, of one dataset or part."""

    x: np.ndarray
    y: np.ndarray
    num_classes: int
    name: str
    groups: np.ndarray | None = None  # a natural silo per sample (hospital, speaker), if any

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ValueError(f"{self.name}: {len(self.x)} samples but {len(self.y)} labels")
        if self.groups is not None and len(self.groups) != len(self.y):
            raise ValueError(f"{self.name}: {len(self.groups)} groups for {len(self.y)} samples")

    def __len__(self) -> int:
        return len(self.y)

    def subset(self, indices: np.ndarray) -> LabelledData:
        groups = None if self.groups is None else self.groups[indices]
        return LabelledData(self.x[indices], self.y[indices], self.num_classes, self.name, groups)

    def class_counts(self) -> list[int]:
        return np.bincount(self.y, minlength=self.num_classes).tolist()  # type: ignore[no-any-return]
