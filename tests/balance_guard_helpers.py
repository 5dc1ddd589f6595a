"""Shared helpers of the StabilityGuard tests (tests/test_balance_guard_*.py, and
tests/test_flower_verdicts.py): sizes at equal and unequal batches, each silo's own and a
scattered update norm, and a guard's verdict on them."""

from __future__ import annotations

EQUAL = {"a": 32, "b": 32, "c": 32}


UNEQUAL = {"a": 16, "b": 26, "c": 54}


OWN = {"a": 1.0, "b": 2.0, "c": 0.5}  # non-IID: raw dispersion 0.54 at equal sizes


SCATTERED = {"a": 0.9, "b": 3.0, "c": 1.35}  # against OWN: scattered, and grown 1.7x


def judged(guard, rounds):
    """Feed (norms, sizes) rounds to `guard`; the last verdict."""
    for norms, sizes in rounds:
        verdict = guard.check(norms, None, sizes)
    return verdict


def scaled(norms, factor):
    return {n: factor * v for n, v in norms.items()}
