"""Equal silos at their real speed: how far apart the default balancer's sizes drift.

Flower's quickstart-pytorch, made load-balanced (tests/apps/adopt.py), on 3 and 10 equal
silos in one process for 10 rounds (its own ServerApp main and ClientApp, an in-process
grid: tests/dropin_helpers.py's `equal_silos_run`), the same run on two clocks side
by side:

- `real`: no emulation; every silo reports what its steps took on this machine
  (milliseconds of compute per step: the timings are mostly noise, and on a busy machine
  mostly the other processes' doing);
- `noisy model`: the model clock, τ·B/v times exp(N(0, 0.2²)) (fixed costs exp(N(0,
  0.5²))), seeded: what tests/test_flower_dropin_equal_silos.py's
  test_equal_silos_under_timing_noise_keep_their_sizes asserts (≤ 1.5x every round).

Printed per run: the largest max/min of the sizes over rounds 1-10 and the round it came
in, the last round's max/min, and the load average beside it. The test holds the claim
(noise in, nothing out) on a clock it controls; this measures what a machine's own noise
does, quiet or busy (`python3 -c "while True: pass" &` twice beside it on 2 cores).

    .venv/bin/python benchmarks/equal_silos.py [--silos 3 10] [--json out.json]

Clock: both named above; wall time of each run printed too. A few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fedlb._flower_internals import task_identity
from tests.dropin_helpers import NoisyModelClock, equal_silos_run


def spread(sizes: dict[str, tuple[int, int, int]]) -> float:
    after = [b for _, b, _ in sizes.values()]
    return max(after) / min(after)


def one_run(silos: int, clock: str) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory() as folder,
        task_identity(run_id=1, task_id=1, node_id=0),
        contextlib.chdir(folder),
        contextlib.redirect_stdout(sys.stderr),  # the app's own prints
    ):
        began = time.perf_counter()
        rounds = equal_silos_run(
            Path(folder), silos, NoisyModelClock(seed=0) if clock == "noisy model" else None
        )
        wall = time.perf_counter() - began
    ratios = {k: spread(sizes) for k, sizes in sorted(rounds.items())}
    worst = max(ratios, key=lambda k: ratios[k])
    return {
        "silos": silos,
        "clock": clock,
        "rounds": len(ratios),
        "worst_ratio": round(ratios[worst], 3),
        "worst_round": worst,
        "last_ratio": round(ratios[max(ratios)], 3),
        "ratios": [round(r, 3) for r in ratios.values()],
        "wall_s": round(wall, 1),
        "load_average": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--silos", type=int, nargs="+", default=[3, 10])
    parser.add_argument("--json", type=Path, help="write the rows here too")
    options = parser.parse_args()
    rows = [one_run(n, clock) for n in options.silos for clock in ("real", "noisy model")]
    print(
        f"{'silos':>5}  {'clock':<12} {'worst max/min':>13} {'round':>5} {'last':>6}"
        f" {'wall s':>7} {'load':>5}"
    )
    for row in rows:
        print(
            f"{row['silos']:>5}  {row['clock']:<12} {row['worst_ratio']:>13.3f}"
            f" {row['worst_round']:>5} {row['last_ratio']:>6.3f} {row['wall_s']:>7.1f}"
            f" {row['load_average']:>5.2f}"
        )
    if options.json:
        options.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
