"""fedlb.flower: the Flower adapters, and fedlb's deployment as a library.

Making a Flower app load-balanced (docs/flower.md):
- `LoadBalancedFedAvg`: the strategy, a drop-in for Flower's FedAvg; `PollingGrid`.
- `balance_mod`, `balanced_loader` (`BalancedLoader`, `SiloClock`): anybody's ClientApp.
- `he_mod`, `EncryptedAggregation`, `EncryptedModel`, `save_encrypted`, `load_encrypted`,
  `decrypt_record`: updates averaged under CKKS, the server never seeing a model.
- `train_reply`, `evaluate_reply`, `run_app`: fedlb's own silo handlers and ServerApp body.

Running fedlb (what `fedlb server`, `fedlb silo` and `fedlb demo` parse options for):
- `server_settings`, `silo_settings` (`ServerSettings`, `SiloSettings`, `RunConfig`):
  settings from TOML with the caller's values on top, checked (`ConfigError`).
- `run_server`, `start_silo`, `resume_settings`, `local_silos`, `check_run_folder`: run them
  (`RunOutcome`, `ServerReady`, `DeployError`); `Federation`: Flower's processes on this
  machine (a simulation SuperLink included); `check_partition`.
- `make_certificates`, `make_silo_key` (`TlsFiles`, `TlsError`): TLS and silo keys.
- `Checkpoint`, `load_checkpoint`, `save_checkpoint` (`CheckpointError`): a run's state.
- `RoundRecord`, `SiloRound`, `RoundReporter`, `records_from_json_lines`,
  `summarise_rounds`, `accuracy_of`, `compare_runs`, `middle_rounds`: per-round results
  and what they add up to.
- `read_toml`, `dataclass_arguments`: settings files and checked dataclasses (scenarios).

The wire protocol (every key fedlb adds to Flower's messages) is `fedlb.flower.protocol`;
fedlb's ServerApp and ClientApp modules are `fedlb.flower.server_app` / `client_app`.
Names are imported on first use: a silo process that handles one message should not pay
for the server side's imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same names, eagerly, for type checkers
    from .checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
    from .config import ConfigError, RunConfig, dataclass_arguments, read_toml
    from .deploy import DeployError
    from .deployment import (
        ServerReady,
        check_run_folder,
        resume_settings,
        run_server,
        start_silo,
    )
    from .dropin import BalancedLoader, SiloClock, balance_mod, balanced_loader
    from .grid import PollingGrid
    from .he import (
        EncryptedAggregation,
        EncryptedModel,
        decrypt_record,
        he_mod,
        load_encrypted,
        save_encrypted,
    )
    from .launch import Federation, RunOutcome
    from .report import (
        RoundRecord,
        RoundReporter,
        SiloRound,
        accuracy_of,
        compare_runs,
        middle_rounds,
        records_from_json_lines,
        summarise_rounds,
    )
    from .server_app import run_app
    from .settings import (
        ServerSettings,
        SiloSettings,
        local_silos,
        server_settings,
        silo_settings,
    )
    from .silo import evaluate_reply, train_reply
    from .strategy import LoadBalancedFedAvg
    from .task import check_partition
    from .tls import TlsError, TlsFiles, make_certificates, make_silo_key

_EXPORTS = {
    "LoadBalancedFedAvg": ".strategy",
    "PollingGrid": ".grid",
    "BalancedLoader": ".dropin",
    "SiloClock": ".dropin",
    "balance_mod": ".dropin",
    "balanced_loader": ".dropin",
    "EncryptedAggregation": ".he",
    "EncryptedModel": ".he",
    "decrypt_record": ".he",
    "he_mod": ".he",
    "load_encrypted": ".he",
    "save_encrypted": ".he",
    "evaluate_reply": ".silo",
    "train_reply": ".silo",
    "run_app": ".server_app",
    "ConfigError": ".config",
    "RunConfig": ".config",
    "dataclass_arguments": ".config",
    "read_toml": ".config",
    "ServerSettings": ".settings",
    "SiloSettings": ".settings",
    "local_silos": ".settings",
    "server_settings": ".settings",
    "silo_settings": ".settings",
    "ServerReady": ".deployment",
    "resume_settings": ".deployment",
    "run_server": ".deployment",
    "check_run_folder": ".deployment",
    "start_silo": ".deployment",
    "DeployError": ".deploy",
    "Federation": ".launch",
    "RunOutcome": ".launch",
    "check_partition": ".task",
    "TlsError": ".tls",
    "TlsFiles": ".tls",
    "make_certificates": ".tls",
    "make_silo_key": ".tls",
    "Checkpoint": ".checkpoint",
    "CheckpointError": ".checkpoint",
    "load_checkpoint": ".checkpoint",
    "save_checkpoint": ".checkpoint",
    "RoundRecord": ".report",
    "RoundReporter": ".report",
    "SiloRound": ".report",
    "accuracy_of": ".report",
    "records_from_json_lines": ".report",
    "summarise_rounds": ".report",
    "compare_runs": ".report",
    "middle_rounds": ".report",
}

__all__ = [
    "BalancedLoader",
    "Checkpoint",
    "CheckpointError",
    "ConfigError",
    "DeployError",
    "EncryptedAggregation",
    "EncryptedModel",
    "Federation",
    "LoadBalancedFedAvg",
    "PollingGrid",
    "RoundRecord",
    "RoundReporter",
    "RunConfig",
    "RunOutcome",
    "ServerReady",
    "ServerSettings",
    "SiloClock",
    "SiloRound",
    "SiloSettings",
    "TlsError",
    "TlsFiles",
    "accuracy_of",
    "balance_mod",
    "balanced_loader",
    "check_partition",
    "check_run_folder",
    "compare_runs",
    "dataclass_arguments",
    "decrypt_record",
    "evaluate_reply",
    "he_mod",
    "load_checkpoint",
    "load_encrypted",
    "local_silos",
    "make_certificates",
    "make_silo_key",
    "middle_rounds",
    "read_toml",
    "records_from_json_lines",
    "resume_settings",
    "run_app",
    "run_server",
    "save_checkpoint",
    "save_encrypted",
    "server_settings",
    "silo_settings",
    "start_silo",
    "summarise_rounds",
    "train_reply",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fedlb.flower' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
