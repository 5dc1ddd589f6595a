"""A user's own app run by `fedlb server --app DIR`: its LoadBalanced strategy keeps the
run's files in the folder fedlb's server gives it, and goes on from a checkpoint there,
without a line of the app changed.

fedlb's server starts Flower's processes with two environment variables, which the
ServerApp process inherits:
- `FEDLB_RUN_DIR`: the run's out-dir. A LoadBalanced strategy given no reporter of its
  own writes rounds.jsonl (the server's console and live page read it), a checkpoint
  after every round, and summary.json at the end there.
- `FEDLB_RESUME`: the same folder, when the run goes on after a stop (`fedlb server
  --resume`): the strategy takes up its checkpoint (balancer, guard, labels) and starts
  from the checkpoint's model instead of the app's initial one.
Neither is set in any other run: a ServerApp outside fedlb's server keeps what it asks for.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from .options import Keeping
from .records import RUN_FILES, Checkpoint, RoundReporter, load_checkpoint

RUN_DIR_ENV = "FEDLB_RUN_DIR"
RESUME_ENV = "FEDLB_RESUME"


def deployed(keeping: Keeping) -> tuple[Keeping, Checkpoint | None]:
    """`keeping` as fedlb's server asks for it (the run's folder for records and
    checkpoints, where the app gave none of its own), and the checkpoint to go on from
    (None: a fresh run)."""
    folder = os.environ.get(RUN_DIR_ENV)
    if not folder or keeping.reporter is not None:
        return keeping, None
    resume = os.environ.get(RESUME_ENV)
    checkpoint = load_checkpoint(Path(resume)) if resume else None
    reporter = RoundReporter(
        Path(folder),
        keep_before=checkpoint.first_unpublished_round if checkpoint else None,
        done=checkpoint.round if checkpoint else None,
        num_rounds=checkpoint.num_rounds if checkpoint else None,
    )
    kept = replace(
        keeping,
        reporter=reporter,
        checkpoint_dir=keeping.checkpoint_dir or Path(folder),
        run_settings=dict(keeping.run_settings) or dict(checkpoint.settings if checkpoint else {}),
    )
    return kept, checkpoint


def write_summary(reporter: RoundReporter, extra: dict[str, Any]) -> None:
    """summary.json in the reporter's folder (the run's, where `deployed` made it), as
    fedlb's own ServerApp writes it."""
    if reporter.out_dir is None:
        return
    summary = {**reporter.summary(), **extra}
    (reporter.out_dir / RUN_FILES.summary).write_text(json.dumps(summary, indent=2))
