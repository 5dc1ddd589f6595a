"""fedlb.flower: the Flower adapters.

- `LoadBalancedFedAvg`: the strategy (server side), a drop-in for Flower's FedAvg.
- `balance_mod`, `balanced_loader`: make somebody's own ClientApp balanced (docs/flower.md).
- `train_reply` / `evaluate_reply`: fedlb's silo message handlers, built on the same two.
- the wire protocol (every key fedlb adds to Flower's messages): `fedlb.flower.protocol`.
- `RunConfig`: the run's settings; `RoundReporter`, `RoundRecord`: per-round results.
- `Checkpoint`, `save_checkpoint`, `load_checkpoint`: a run's state after a round, to resume.
- `PollingGrid`: waits for replies at a short interval instead of Flower's 3 s.
- `Federation`, `start_supernode`: Flower's processes on this machine (CLI, tests).
- fedlb's own ServerApp and ClientApp live in `fedlb.flower.server_app` / `client_app`.

Names are imported on first use: a silo process that handles one message should not pay
for the server side's imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same names, eagerly, for type checkers
    from .checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
    from .config import (
        DATASETS,
        RUN_SETTING_HELP,
        ConfigError,
        RunConfig,
        dataclass_arguments,
        read_toml,
    )
    from .deploy import DeployError, free_port, start_supernode
    from .deployment import ServerReady, default_out_dir, resume_settings, run_server, start_silo
    from .dropin import BalancedLoader, SiloClock, balance_mod, balanced_loader
    from .grid import PollingGrid
    from .he import (
        EncryptedAggregation,
        EncryptedModel,
        decrypt_record,
        encrypted_record,
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
        records_from_json_lines,
        render_round,
        summarise_rounds,
    )
    from .server_app import run_app
    from .settings import ServerSettings, SiloSettings, local_silos, server_settings, silo_settings
    from .silo import evaluate_reply, node_settings, train_reply
    from .strategy import LoadBalancedFedAvg
    from .task import check_partition, federation_data, model_for
    from .tls import TlsError, TlsFiles, make_certificates, make_silo_key

_EXPORTS = {
    "Checkpoint": ".checkpoint",
    "CheckpointError": ".checkpoint",
    "load_checkpoint": ".checkpoint",
    "save_checkpoint": ".checkpoint",
    "LoadBalancedFedAvg": ".strategy",
    "BalancedLoader": ".dropin",
    "balance_mod": ".dropin",
    "balanced_loader": ".dropin",
    "PollingGrid": ".grid",
    "EncryptedAggregation": ".he",
    "EncryptedModel": ".he",
    "decrypt_record": ".he",
    "encrypted_record": ".he",
    "he_mod": ".he",
    "load_encrypted": ".he",
    "save_encrypted": ".he",
    "RoundRecord": ".report",
    "RoundReporter": ".report",
    "SiloRound": ".report",
    "RunConfig": ".config",
    "ConfigError": ".config",
    "RUN_SETTING_HELP": ".config",
    "DATASETS": ".config",
    "read_toml": ".config",
    "dataclass_arguments": ".config",
    "render_round": ".report",
    "check_partition": ".task",
    "records_from_json_lines": ".report",
    "accuracy_of": ".report",
    "summarise_rounds": ".report",
    "Federation": ".launch",
    "run_server": ".deployment",
    "run_app": ".server_app",
    "start_silo": ".deployment",
    "resume_settings": ".deployment",
    "default_out_dir": ".deployment",
    "ServerReady": ".deployment",
    "server_settings": ".settings",
    "silo_settings": ".settings",
    "local_silos": ".settings",
    "ServerSettings": ".settings",
    "SiloSettings": ".settings",
    "RunOutcome": ".launch",
    "DeployError": ".deploy",
    "free_port": ".deploy",
    "start_supernode": ".deploy",
    "train_reply": ".silo",
    "SiloClock": ".dropin",
    "federation_data": ".task",
    "model_for": ".task",
    "TlsError": ".tls",
    "TlsFiles": ".tls",
    "make_certificates": ".tls",
    "make_silo_key": ".tls",
    "evaluate_reply": ".silo",
    "node_settings": ".silo",
}

__all__ = [
    "DATASETS",
    "RUN_SETTING_HELP",
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
    "dataclass_arguments",
    "decrypt_record",
    "default_out_dir",
    "encrypted_record",
    "evaluate_reply",
    "federation_data",
    "free_port",
    "he_mod",
    "load_checkpoint",
    "load_encrypted",
    "local_silos",
    "make_certificates",
    "make_silo_key",
    "model_for",
    "node_settings",
    "read_toml",
    "records_from_json_lines",
    "render_round",
    "resume_settings",
    "run_app",
    "run_server",
    "save_checkpoint",
    "save_encrypted",
    "server_settings",
    "silo_settings",
    "start_silo",
    "start_supernode",
    "summarise_rounds",
    "train_reply",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fedlb.flower' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
