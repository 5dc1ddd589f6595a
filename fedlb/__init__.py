"""fedlb: load-balanced cross-silo federated learning on Flower.

Every silo gets a batch size sized to its measured speed, so all finish their τ local
iterations together; τ and the learning rate are never touched. See docs/ and the README.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("fedlb")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
