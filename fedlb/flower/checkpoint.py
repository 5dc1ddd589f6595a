"""Per-round checkpoints of a federated run: one file, replaced atomically after every round.

What a checkpoint holds is what the server needs to go on as if it had never stopped: the
global model after the round (ciphertexts under HE: the server never had more), the
strategy's state (the BatchSizeManager with every estimator and the tuner, the node-sampling
RNG, silo labels, the round's record not yet published), the round number, and the run's
settings. Results so far are in the run's rounds.jsonl; resuming keeps the rounds the
checkpoint covers and drops any written after it.
"""

from __future__ import annotations

import json
import os
import random
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord

from fedlb.balance import BatchSizeManager

from .membership import Membership
from .report import record_from_dict, record_to_dict
from .rounds import RoundLog

CHECKPOINT_VERSION = 1
CHECKPOINT_FILE = "checkpoint.npz"


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable or does not fit the run; says which and why."""


@dataclass
class Checkpoint:
    """The state after round `round` of a run of `num_rounds`."""

    round: int
    num_rounds: int
    arrays: ArrayRecord  # the global model after `round` (ciphertexts under HE)
    strategy: dict[str, Any]  # LoadBalancedFedAvg.state_dict()
    settings: dict[str, Any]  # the run's settings (RunConfig.to_mapping()), or {}

    @property
    def first_unpublished_round(self) -> int:
        """The first round not yet in rounds.jsonl when this was written: the last round's
        record waits in the strategy (for its evaluation) until the next round."""
        pending = self.strategy.get("pending")
        return int(pending["round"]) if pending else self.round + 1


def checkpoint_path(run_dir: Path) -> Path:
    return run_dir / CHECKPOINT_FILE


def save_checkpoint(run_dir: Path, checkpoint: Checkpoint) -> Path:
    """Write `run_dir/checkpoint.npz`: to a temporary file first, synced, then renamed over
    the old one, so a crash at any moment leaves the previous checkpoint or the new one
    whole, never a mix."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(run_dir)
    meta = {
        "version": CHECKPOINT_VERSION,
        "round": checkpoint.round,
        "num_rounds": checkpoint.num_rounds,
        "keys": list(checkpoint.arrays.keys()),
        "strategy": checkpoint.strategy,
        "settings": checkpoint.settings,
    }
    entries = {f"array-{i}": a.numpy() for i, a in enumerate(checkpoint.arrays.values())}
    entries["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    temporary = path.with_name(f".{CHECKPOINT_FILE}.{os.getpid()}.tmp")
    try:
        with temporary.open("wb") as handle:
            np.savez(handle, **entries)  # type: ignore[arg-type]
            handle.flush()
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
            f"no checkpoint in {run_dir} ({CHECKPOINT_FILE} is missing): a run writes one "
            "after every completed round when it has an out-dir; give the run's out-dir"
        )
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(bytes(data["meta"]).decode())
            if not isinstance(meta, dict) or meta.get("version") != CHECKPOINT_VERSION:
                version = meta.get("version") if isinstance(meta, dict) else None
                raise CheckpointError(
                    f"{path} is checkpoint version {version!r}, this fedlb reads "
                    f"{CHECKPOINT_VERSION}"
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
    except CheckpointError:
        raise
    except Exception as error:  # zip, JSON, key and type errors alike: a damaged file
        raise CheckpointError(
            f"{path} is damaged or not a fedlb checkpoint ({type(error).__name__}: {error})"
        ) from error
    if not 1 <= checkpoint.round <= checkpoint.num_rounds:
        raise CheckpointError(
            f"{path} says round {checkpoint.round} of {checkpoint.num_rounds}: not a "
            "completed round"
        )
    return checkpoint


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


def strategy_state(
    manager: BatchSizeManager | None, rng: random.Random, members: Membership, rounds: RoundLog
) -> dict[str, Any]:
    """What a resumed run needs of the strategy's parts (JSON-serialisable): the balancer
    with its estimators and tuner, the sampling RNG, the silos' labels, who is left out and
    what each brought to X, and the last round's record if still unpublished."""
    version, internal, gauss = rng.getstate()
    pending = rounds.pending
    return {
        "manager": None if manager is None else manager.state_dict(),
        "rng": [version, list(internal), gauss],
        **members.state_dict(),
        "pending": None if pending is None else record_to_dict(pending),
    }


def restore_strategy_state(
    state: Mapping[str, Any],
    balancer: Callable[[Mapping[str, int]], BatchSizeManager],
    rng: random.Random,
    members: Membership,
    rounds: RoundLog,
) -> BatchSizeManager | None:
    """Put `strategy_state` back into the parts; the balancer, rebuilt with `balancer`.
    CheckpointError if the state does not fit (another fedlb, another balancer kind)."""
    try:
        manager = None
        if state["manager"] is not None:
            manager_state = state["manager"]
            manager = balancer({w: int(b) for w, b in manager_state["sizes"].items()})
            manager.load_state_dict(manager_state)
        version, internal, gauss = state["rng"]
        rng.setstate((int(version), tuple(int(x) for x in internal), gauss))
        members.load_state_dict(dict(state))
        pending = state["pending"]
        rounds.pending = None if pending is None else record_from_dict(pending)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointError(
            f"the checkpoint's strategy state does not fit this strategy: {error!r}"
        ) from error
    return manager
