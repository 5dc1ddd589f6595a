"""fedlb.flower.records: what a run keeps of itself, apart from how its rounds are driven.

- `RoundRecord` (with its `SiloRound`s): one round as it happened (sizes, seconds, the
  ideal, accuracy), built by `round_record`, shown by `balance_line` and `compare_runs`,
  added up by `summarise_rounds`; `RoundLog`: the record of the round in progress, as the
  strategy fills it.
- `RoundReporter`: where finished records go (the console table, rounds.jsonl,
  TensorBoard); `records_from_json_lines` reads a rounds file back (`RecordsError`).
- `Checkpoint`, `save_checkpoint`, `load_checkpoint`, `check_resume`,
  `start_run_identity` (`CheckpointError`): a run's state after every round, sealed.
- `RUN_FILES`: the name of every file of a run's out-dir.

The Flower adapter (`fedlb.flower`) writes these; nothing here drives a round. Names are
imported on first use, as `fedlb.flower`'s are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedlb._faces import lazy_face

if TYPE_CHECKING:  # the same names, eagerly, for type checkers
    from .checkpoint import (
        Checkpoint,
        CheckpointError,
        check_resume,
        load_checkpoint,
        save_checkpoint,
        start_run_identity,
    )
    from .files import RUN_FILES
    from .record import (
        RoundRecord,
        SiloRound,
        accuracy_of,
        balance_line,
        compare_runs,
        record_from_dict,
        record_to_dict,
        round_record,
        summarise_rounds,
    )
    from .round_log import RoundLog, attach_evaluation, audit_round
    from .rounds_file import RecordsError, RoundReporter, records_from_json_lines

__all__ = [
    "RUN_FILES",
    "Checkpoint",
    "CheckpointError",
    "RecordsError",
    "RoundLog",
    "RoundRecord",
    "RoundReporter",
    "SiloRound",
    "accuracy_of",
    "attach_evaluation",
    "audit_round",
    "balance_line",
    "check_resume",
    "compare_runs",
    "load_checkpoint",
    "record_from_dict",
    "record_to_dict",
    "records_from_json_lines",
    "round_record",
    "save_checkpoint",
    "start_run_identity",
    "summarise_rounds",
]

__getattr__ = lazy_face(
    __name__,
    {
        ".checkpoint": [
            "Checkpoint",
            "CheckpointError",
            "check_resume",
            "load_checkpoint",
            "save_checkpoint",
            "start_run_identity",
        ],
        ".files": ["RUN_FILES"],
        ".record": [
            "RoundRecord",
            "SiloRound",
            "accuracy_of",
            "balance_line",
            "compare_runs",
            "record_from_dict",
            "record_to_dict",
            "round_record",
            "summarise_rounds",
        ],
        ".round_log": ["RoundLog", "attach_evaluation", "audit_round"],
        ".rounds_file": ["RecordsError", "RoundReporter", "records_from_json_lines"],
    },
)
