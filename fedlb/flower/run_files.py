"""The files of a run's out-dir, one table: whoever writes or reads one names it from here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunFiles:
    rounds: str = "rounds.jsonl"  # one JSON line per silo and round
    summary: str = "summary.json"
    model: str = "model.pt"  # the final model, a torch state dict
    encrypted_model: str = "model.ckks.npz"  # under HE: still encrypted (`fedlb decrypt`)
    checkpoint: str = "checkpoint.npz"
    run: str = "run.json"  # the run a folder holds: {"run-id", "settings-digest", "started"}


RUN_FILES = RunFiles()
