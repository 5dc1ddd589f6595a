"""Lazy package faces: a face names its exports, each imported on first use, so a process
that needs one corner of a package (a silo handling one message) does not pay for the rest."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy_face(package: str, exports: Mapping[str, Sequence[str]]) -> Callable[[str], Any]:
    """The module `__getattr__` of `package`, whose face exports the names `exports`
    lists per inner module (".strategy": ["LoadBalancedFedAvg"]); the face's `__all__`
    lists the same names (tests/test_layers.py checks that they agree)."""
    where = {name: module for module, names in exports.items() for name in names}

    def attribute(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(where[name], package), name)

    return attribute
