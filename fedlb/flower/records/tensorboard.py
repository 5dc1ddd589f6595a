"""Each finished round's figures as TensorBoard scalars, beside rounds.jsonl: so that
`tensorboard --logdir runs/` shows a federation's balance, timings and accuracy next to
the rest of a PyTorch user's training. Written through `torch.utils.tensorboard` (the
`tensorboard` package: fedlb's `tensorboard` extra); the step is the round number.

The tags, one table: `round/...` for the round (E, its time against the ideal T*, the
wall clock, the idle share), `model/...` for what the model reached, and
`silo/<label>/...` for each silo's batch size and seconds.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .record import RoundRecord, SiloRound

# tag -> the figure in a round record (None: not measured that round, nothing written)
ROUND_SCALARS: dict[str, Callable[[RoundRecord], float | None]] = {
    "round/E": lambda r: r.efficiency,
    "round/T_round_s": lambda r: r.round_s,  # the slowest silo's busy time
    "round/T_ideal_s": lambda r: r.ideal_s,  # T*: the best split for the measured speeds
    "round/wall_s": lambda r: r.wall_s,  # the training phase, framework included
    "round/idle_fraction": lambda r: r.idle_fraction,
    "model/accuracy": lambda r: r.accuracy,  # federated evaluation
    "model/loss": lambda r: r.loss,
    "model/server_accuracy": lambda r: r.server_accuracy,  # the server's test set
    "model/server_loss": lambda r: r.server_loss,
}
SILO_SCALARS: dict[str, Callable[[SiloRound], float | None]] = {
    "B": lambda s: s.batch_size,
    "compute_s": lambda s: s.compute_s,
    "fixed_s": lambda s: s.fixed_s,
    "idle_s": lambda s: s.idle_s,
    "start_s": lambda s: s.start_s,  # its ClientApp's start-up
    "wall_s": lambda s: s.wall_s,  # the server's clock: pushed -> replied
    "train_loss": lambda s: s.train_loss,
    "accuracy": lambda s: s.accuracy,
}
EXTRA = "pip install 'fedlb[tensorboard]' (or ./scripts/setup.sh dev,simulation)"


def tensorboard_installed() -> bool:
    """Whether the `tensorboard` package that torch.utils.tensorboard writes with is here."""
    return importlib.util.find_spec("tensorboard") is not None


class RoundScalars:
    """A run's TensorBoard event files in `log_dir`, one step per round. `first_round`:
    a resumed run's first round; events a stopped run wrote from it on are dropped
    (TensorBoard's purge_step), as rounds.jsonl's are."""

    def __init__(self, log_dir: Path, first_round: int = 1) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self.writer: Any = SummaryWriter(str(log_dir), purge_step=first_round)

    def write(self, record: RoundRecord) -> None:
        step = record.round
        for tag, figure in ROUND_SCALARS.items():
            value = figure(record)
            if value is not None:
                self.writer.add_scalar(tag, value, step)
        for silo in record.silos:
            for name, silo_figure in SILO_SCALARS.items():
                value = silo_figure(silo)
                if value is not None:
                    self.writer.add_scalar(f"silo/{silo.silo}/{name}", value, step)
        self.writer.flush()  # a live `tensorboard` sees the round now, not at the run's end

    def close(self) -> None:
        self.writer.close()
