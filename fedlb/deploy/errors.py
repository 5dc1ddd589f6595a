"""The deployment's own error, below every module that raises it."""

from __future__ import annotations


class DeployError(RuntimeError):
    """A Flower process that would not start, or a run that could not be submitted."""
