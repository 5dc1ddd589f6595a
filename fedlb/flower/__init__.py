"""fedlb.flower: the Flower adapters.

- `LoadBalancedFedAvg`: the strategy (server side), a drop-in for Flower's FedAvg.
- `LocalRound`: makes somebody's own ClientApp training balanced (docs/flower.md).
- `train_reply` / `evaluate_reply`: fedlb's silo message handlers.
- `RunConfig`: the run's settings; `RoundReporter`, `RoundRecord`: per-round results.
- `PollingGrid`: waits for replies at a short interval instead of Flower's 3 s.
- fedlb's own ServerApp and ClientApp live in `fedlb.flower.server_app` / `client_app`.

Names are imported on first use: a silo process that handles one message should not pay
for the server side's imports.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LoadBalancedFedAvg": ".strategy",
    "LocalRound": ".dropin",
    "default_estimator": ".strategy",
    "PollingGrid": ".grid",
    "RoundRecord": ".report",
    "RoundReporter": ".report",
    "SiloRound": ".report",
    "RunConfig": ".config",
    "ConfigError": ".config",
    "train_reply": ".silo",
    "evaluate_reply": ".silo",
    "node_settings": ".silo",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fedlb.flower' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
