"""Per-round checkpoints of a federated run: one file, replaced atomically after every round.

What a checkpoint holds is what the server needs to go on as if it had never stopped: the
global model after the round (ciphertexts under HE: the server never had more), fedlb's
side of the strategy (the BatchSizeManager with every estimator and the tuner, silo labels,
the round's record not yet published), the round number, and the run's settings. Results
so far are in the run's rounds.jsonl; resuming keeps the rounds the checkpoint covers and
drops any written after it.

A checkpoint belongs to one run: fedlb's server writes the run's id and its settings'
digest to run.json in the run folder when the run starts, every checkpoint carries both,
and a checkpoint whose id or settings are not its folder's run's is refused (one copied
in from another run would otherwise write that run's rounds into this one's results).
Every byte of it is checked on load before anything in it is read: the file is sealed
with its own digest at its end (`fedlb.security.seal_zip`: zip headers and central
directory as much as the arrays). A digest of its content is stored inside it too, which
is all a checkpoint written before fedlb sealed its files has, and all an older fedlb checks.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord

from fedlb.security import DigestError, StoredFileError, check_seal, open_stored, seal_zip

from .files import RUN_FILES, parse_json, read_json_object
from .rounds_file import RecordsError, resume_round_lines

CHECKPOINT_VERSION = 2  # 2: run id, settings digest, content digest


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable or does not fit the run; says which and why."""


@dataclass
class Checkpoint:
    """The state after round `round` of a run of `num_rounds`."""

    round: int
    num_rounds: int
    arrays: ArrayRecord  # the global model after `round` (ciphertexts under HE)
    strategy: dict[str, Any]  # LoadBalanced.state_dict()
    settings: dict[str, Any]  # the run's settings (RunConfig.to_mapping()), or {}

    @property
    def first_unpublished_round(self) -> int:
        """The first round not yet in rounds.jsonl when this was written: the last round's
        record waits in the strategy (for its evaluation) until the next round."""
        pending = self.strategy.get("pending")
        return int(pending["round"]) if pending else self.round + 1

    def story(self, num_rounds: int, run_dir: Path | None = None) -> str:
        """Where a resumed run stands, in the words the operator checks it against: which
        rounds rounds.jsonl holds, which record this checkpoint carries, which are left.
        With the run's folder, what its rounds.jsonl holds is read, not assumed (a
        CheckpointError naming a damaged line)."""
        done, first_unpublished = self.round, self.first_unpublished_round
        on_file = (
            "none of them in rounds.jsonl yet"
            if first_unpublished == 1
            else f"rounds.jsonl holds round{'s 1-' if first_unpublished > 2 else ' '}"
            f"{first_unpublished - 1}"
        )
        if run_dir is not None and first_unpublished > 1:
            try:
                path = run_dir / RUN_FILES.rounds
                on_file = resume_round_lines(path, first_unpublished, done).holds()
            except RecordsError as error:
                raise CheckpointError(str(error)) from error
        if first_unpublished <= done:
            on_file += (
                f"; round {done}'s record is in the checkpoint and is written when round "
                f"{done + 1}'s replies complete its evaluation"
            )
        left = f"round {done + 1}" if num_rounds == done + 1 else f"rounds {done + 1}-{num_rounds}"
        finished = "round 1" if done == 1 else f"rounds 1-{done}"
        return f"{finished} of {num_rounds} done ({on_file}); {left} to go"


def checkpoint_path(run_dir: Path) -> Path:
    return run_dir / RUN_FILES.checkpoint


def save_checkpoint(run_dir: Path, checkpoint: Checkpoint) -> Path:
    """Write `run_dir/checkpoint.npz`: to a temporary file first, synced, then renamed over
    the old one, so a crash at any moment leaves the previous checkpoint or the new one
    whole, never a mix."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(run_dir)
    identity = run_identity(run_dir)
    meta = {
        "version": CHECKPOINT_VERSION,
        "round": checkpoint.round,
        "num_rounds": checkpoint.num_rounds,
        "keys": list(checkpoint.arrays.keys()),
        "strategy": checkpoint.strategy,
        "settings": checkpoint.settings,
        "run-id": identity.get("run-id") if identity else None,
        "settings-digest": settings_digest(checkpoint.settings),
    }
    entries = {f"array-{i}": a.numpy() for i, a in enumerate(checkpoint.arrays.values())}
    entries["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    entries["digest"] = np.frombuffer(_content_digest(entries).encode(), dtype=np.uint8)
    temporary = path.with_name(f".{RUN_FILES.checkpoint}.{os.getpid()}.tmp")
    try:
        with temporary.open("w+b") as handle:
            np.savez(handle, **entries)  # type: ignore[arg-type]
            seal_zip(handle)
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    directory = os.open(run_dir, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a power cut
    finally:
        os.close(directory)
    return path


def load_checkpoint(run_dir: Path) -> Checkpoint:
    """The checkpoint in `run_dir`, or a CheckpointError that says what is wrong."""
    path = checkpoint_path(run_dir)
    if not path.exists():
        raise CheckpointError(
            f"no checkpoint in {run_dir} ({RUN_FILES.checkpoint} is missing): a run writes one "
            "after every completed round when it has an out-dir; give the run's out-dir"
        )
    try:
        check_seal(path)  # True, or False for one written before fedlb sealed its files
        with open_stored(path) as handle, np.load(handle, allow_pickle=False) as data:
            stored = {name: np.array(data[name]) for name in data.files}
            digest = stored.pop("digest", None)
            intact = digest is not None and bytes(digest).decode() == _content_digest(stored)
            try:
                # bounded: its digest catches damage, not a value built to crash the reader
                meta = parse_json(bytes(stored["meta"]), max_depth=64)
            except (KeyError, ValueError):
                meta = None
            version = meta.get("version") if isinstance(meta, dict) else None
            if isinstance(version, int) and version != CHECKPOINT_VERSION:
                raise CheckpointError(
                    f"{path} is checkpoint version {version!r}, this fedlb reads "
                    f"{CHECKPOINT_VERSION}"
                )
            if not intact or not isinstance(meta, dict):
                raise CheckpointError(
                    f"{path} is damaged: its content does not match the digest stored in it "
                    "(changed after fedlb wrote it); resume from a copy, or start a new run"
                )
            keys = meta["keys"]
            arrays = ArrayRecord(
                OrderedDict((k, Array(np.array(data[f"array-{i}"]))) for i, k in enumerate(keys))
            )
            checkpoint = Checkpoint(
                round=int(meta["round"]),
                num_rounds=int(meta["num_rounds"]),
                arrays=arrays,
                strategy=dict(meta["strategy"]),
                settings=dict(meta["settings"]),
            )
            run_id = meta.get("run-id")
    except CheckpointError:
        raise
    except StoredFileError as error:  # a FIFO or a device in its place: never read
        raise CheckpointError(f"{error}; give the out-dir of a run fedlb wrote") from None
    except DigestError as error:
        raise CheckpointError(f"{error}; resume from a copy, or start a new run") from error
    except Exception as error:  # zip, JSON, key and type errors alike: a damaged file
        raise CheckpointError(
            f"{path} is damaged or not a fedlb checkpoint ({type(error).__name__}: {error})"
        ) from error
    if not 1 <= checkpoint.round <= checkpoint.num_rounds:
        raise CheckpointError(
            f"{path} says round {checkpoint.round} of {checkpoint.num_rounds}: not a "
            "completed round"
        )
    _check_belongs(path, run_id, checkpoint.settings, run_identity(run_dir))
    try:
        first_unpublished = checkpoint.first_unpublished_round
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{path}: its round record is unreadable ({error!r})") from error
    try:  # the rounds on file must be readable to go on from it (nothing is changed here)
        resume_round_lines(run_dir / RUN_FILES.rounds, first_unpublished, checkpoint.round)
    except RecordsError as error:
        raise CheckpointError(str(error)) from error
    return checkpoint


def _content_digest(entries: Mapping[str, np.ndarray]) -> str:
    """sha256 over every entry's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(entries):
        array = np.ascontiguousarray(entries[name])
        digest.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def settings_digest(settings: Mapping[str, Any]) -> str:
    """A digest of the settings a run must keep when resumed (all but RESUME_MAY_CHANGE)."""
    kept = {k: v for k, v in settings.items() if k not in RESUME_MAY_CHANGE}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def start_run_identity(run_dir: Path, settings: Mapping[str, Any]) -> str:
    """Give the run folder a new run: a fresh id and its settings' digest in run.json
    (checkpoints written there carry both); the id."""
    run_id = uuid.uuid4().hex
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_FILES.run).write_text(
        json.dumps(
            {
                "run-id": run_id,
                "settings-digest": settings_digest(settings),
                "started": datetime.now(UTC).isoformat(timespec="seconds"),
            },
            indent=2,
        )
    )
    return run_id


def run_identity(run_dir: Path) -> dict[str, Any] | None:
    """The folder's run.json (None: none, a run started outside fedlb's server); a
    CheckpointError that names it and says what to do where it is damaged."""
    path = run_dir / RUN_FILES.run
    try:
        identity = read_json_object(path)
        for key in ("run-id", "settings-digest"):
            if not isinstance(identity.get(key), str):
                raise ValueError(f"its {key} is {identity.get(key)!r:.40}, not text")
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        why = error.strerror if isinstance(error, OSError) and error.strerror else error
        raise CheckpointError(
            f"{path} is damaged ({why}): it names the run this folder holds, which the "
            "checkpoint must belong to; restore it from a copy, or start a new run "
            "(--overwrite)"
        ) from error
    return identity


def _check_belongs(
    path: Path, run_id: str | None, settings: Mapping[str, Any], folder: dict[str, Any] | None
) -> None:
    """Refuse a checkpoint that is not of the run its folder holds."""
    folder_id = folder.get("run-id") if folder else None
    if run_id != folder_id:
        theirs = f"run {run_id}" if run_id else "a run without an id"
        ours = f"run {folder_id} (its {RUN_FILES.run})" if folder_id else "no run.json, so no run"
        raise CheckpointError(
            f"{path} belongs to {theirs}, but {path.parent} holds {ours}: the checkpoint was "
            "copied from another run's folder. Resume that run from its own folder, or "
            "start a new run"
        )
    if folder and folder.get("settings-digest") != settings_digest(settings):
        raise CheckpointError(
            f"{path}: its settings are not those the run in {path.parent} started with "
            f"({RUN_FILES.run}'s settings-digest differs); resume from the run's own checkpoint"
        )


# Settings a resumed run may change: num-rounds may grow (go on for longer), the results
# may move; resume itself says where the run comes from.
RESUME_MAY_CHANGE = frozenset({"num-rounds", "out-dir", "resume"})


def check_resume(
    checkpoint: Checkpoint, settings: Mapping[str, Any], num_rounds: int, where: Path | str
) -> None:
    """Refuse to go on from `checkpoint` (of the run in `where`) with other settings than
    its run's, or with fewer rounds than it has done (CheckpointError, naming each)."""
    differing = sorted(
        key
        for key in set(settings) | set(checkpoint.settings)
        if key not in RESUME_MAY_CHANGE and settings.get(key) != checkpoint.settings.get(key)
    )
    if differing:
        raise CheckpointError(
            f"cannot resume {where} with other settings: "
            + ", ".join(
                f"{k} was {checkpoint.settings.get(k)!r}, now {settings.get(k)!r}"
                for k in differing
            )
            + " (resume with the run's own settings; only num-rounds may grow)"
        )
    if num_rounds < checkpoint.round:
        raise CheckpointError(
            f"num-rounds {num_rounds} is below the {checkpoint.round} rounds the checkpoint "
            f"in {where} has done"
        )
