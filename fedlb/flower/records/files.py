"""The files of a run's out-dir, one table: whoever writes or reads one names it from here;
and how fedlb reads a JSON file it wrote, saying in a few words what is wrong with one."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedlb.security import StoredFileError, json_kind, parse_json, read_json

__all__ = ["RUN_FILES", "RunFiles", "json_kind", "parse_json", "read_json_object"]


@dataclass(frozen=True)
class RunFiles:
    rounds: str = "rounds.jsonl"  # one JSON line per silo and round
    summary: str = "summary.json"
    model: str = "model.pt"  # the final model, a torch state dict
    encrypted_model: str = "model.ckks.npz"  # under HE: still encrypted (`fedlb decrypt`)
    checkpoint: str = "checkpoint.npz"
    run: str = "run.json"  # the run a folder holds: {"run-id", "settings-digest", "started"}
    tensorboard: str = "tensorboard"  # a folder: each round's scalars as TensorBoard events
    # the round under way: who was sent it and who has replied, seconds after the push
    progress: str = "round-progress.json"


RUN_FILES = RunFiles()


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path` (fedlb.security.stored's bounds: size, depth, finite
    numbers): FileNotFoundError where there is no file, ValueError (in a few words, the
    reader names the file) where it is damaged or not an object, other OSErrors as they
    come."""
    try:
        value = read_json(path)
    except StoredFileError as error:
        raise ValueError(error.reason) from None
    if not isinstance(value, dict):
        raise ValueError(f"{json_kind(value)}, not a JSON object")
    return value
