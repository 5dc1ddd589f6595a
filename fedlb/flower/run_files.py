"""The files of a run's out-dir, one table: whoever writes or reads one names it from here;
and how fedlb reads a JSON file it wrote, saying in a few words what is wrong with one."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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


def parse_json(data: bytes | str) -> Any:
    """JSON text fedlb wrote, parsed; ValueError, in a few words, where it is not UTF-8
    text or not JSON (whoever reads it names the file and says what to do)."""
    try:
        text = data.decode() if isinstance(data, bytes) else data
    except UnicodeDecodeError as error:
        bad = error.object[error.start]
        raise ValueError(f"not UTF-8 text: byte {error.start + 1} is {bad:#04x}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON: {error.msg} at character {error.pos + 1}") from None


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`: FileNotFoundError where there is no file, ValueError (in
    a few words) where it is not UTF-8 text, not JSON or not an object, other OSErrors as
    they come."""
    value = parse_json(path.read_bytes())
    if not isinstance(value, dict):
        raise ValueError(f"{json_kind(value)}, not a JSON object")
    return value


def json_kind(value: Any) -> str:
    """What a JSON value is, in words."""
    names = {list: "an array", str: "a string", bool: "true or false", type(None): "null"}
    return names.get(type(value), "a number")
