"""fedlb.flower: the Flower adapters, what a user of their own Flower app imports
(docs/flower.md).

- `LoadBalanced(strategy)`: any Flower strategy balanced, wrapped as Flower's DP wrappers
  wrap one; `LoadBalancedFedAvg`, the drop-in for Flower's FedAvg
  (`LoadBalanced(FedAvg(...))`); their options in three groups (`Balancing`, `Joining`,
  `Keeping`); `PollingGrid`.
- `balance_mod`, `balanced_loader` (`BalancedLoader`), `warm_up_torch`:
  anybody's ClientApp, balanced.
- `he_mod`, `EncryptedAggregation`, `EncryptedModel`, `save_encrypted`, `load_encrypted`,
  `decrypt_record`: updates averaged under CKKS, the server never seeing a model.
- `Checkpoint`, `load_checkpoint`, `save_checkpoint`, `check_resume`, `start_run_identity`
  (`CheckpointError`): a run's state, resumable.
- `RoundRecord`, `RoundReporter`, `records_from_json_lines`, `summarise_rounds`,
  `accuracy_of`, `compare_runs`, `round_record`: per-round results and what they add up
  to; `RUN_FILES`: the files of a run's out-dir. These are the run's records, a part of
  their own (`fedlb.flower.records`), named here too for the adapter's users.

The wire protocol (every key fedlb adds to Flower's messages) is the public module
`fedlb.flower.protocol`. Running fedlb's own server and silos is `fedlb.deploy`.
Names are imported on first use: a silo process that handles one message should not pay
for the server side's imports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedlb._faces import lazy_face

if TYPE_CHECKING:  # the same names, eagerly, for type checkers
    from .dropin import BalancedLoader, balance_mod, balanced_loader, warm_up_torch
    from .fedavg import LoadBalancedFedAvg
    from .grid import PollingGrid
    from .he import (
        EncryptedAggregation,
        EncryptedModel,
        decrypt_record,
        he_mod,
        load_encrypted,
        save_encrypted,
    )
    from .options import Balancing, Joining, Keeping
    from .records import (
        RUN_FILES,
        Checkpoint,
        CheckpointError,
        RoundRecord,
        RoundReporter,
        accuracy_of,
        check_resume,
        compare_runs,
        load_checkpoint,
        records_from_json_lines,
        round_record,
        save_checkpoint,
        start_run_identity,
        summarise_rounds,
    )
    from .strategy import LoadBalanced

__all__ = [
    "RUN_FILES",
    "BalancedLoader",
    "Balancing",
    "Checkpoint",
    "CheckpointError",
    "EncryptedAggregation",
    "EncryptedModel",
    "Joining",
    "Keeping",
    "LoadBalanced",
    "LoadBalancedFedAvg",
    "PollingGrid",
    "RoundRecord",
    "RoundReporter",
    "accuracy_of",
    "balance_mod",
    "balanced_loader",
    "check_resume",
    "compare_runs",
    "decrypt_record",
    "he_mod",
    "load_checkpoint",
    "load_encrypted",
    "records_from_json_lines",
    "round_record",
    "save_checkpoint",
    "save_encrypted",
    "start_run_identity",
    "summarise_rounds",
    "warm_up_torch",
]

__getattr__ = lazy_face(
    __name__,
    {
        ".strategy": ["LoadBalanced"],
        ".fedavg": ["LoadBalancedFedAvg"],
        ".grid": ["PollingGrid"],
        ".dropin": [
            "BalancedLoader",
            "balance_mod",
            "balanced_loader",
            "warm_up_torch",
        ],
        ".he": [
            "EncryptedAggregation",
            "EncryptedModel",
            "decrypt_record",
            "he_mod",
            "load_encrypted",
            "save_encrypted",
        ],
        ".records": [
            "RUN_FILES",
            "Checkpoint",
            "CheckpointError",
            "RoundRecord",
            "RoundReporter",
            "accuracy_of",
            "check_resume",
            "compare_runs",
            "load_checkpoint",
            "records_from_json_lines",
            "round_record",
            "save_checkpoint",
            "start_run_identity",
            "summarise_rounds",
        ],
        ".options": ["Balancing", "Joining", "Keeping"],
    },
)
