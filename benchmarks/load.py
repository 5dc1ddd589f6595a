"""Load benchmark of the fedlb server: 5, 10 and 20 silos for 100 rounds each, side by side.

Flower's Simulation Engine (the silos as Ray actors on this machine), the MLP on the
embedded digits, speeds spread 4x (hetero-4:N), tau = 5, B0 = 16, the lb policy (the
Proportional tuner, EMA estimators), a checkpoint after every round as `fedlb server`
writes. Per run, from every round's record:

- server seconds per round: the strategy's own work (select and size the silos, check
  and average the updates, feed the manager, checkpoint), not waiting for silos; and
  the same per silo, whose growth from 5 to 20 silos says whether it is at most linear;
- the server process's resident memory (RSS) at the end of rounds 10 and 100 and its
  least-squares slope over rounds 10..100 (flat: a slope near 0 MB per round);
- balance efficiency E from round 3.

    .venv/bin/python benchmarks/load.py [--quick] [--json results.json]

Clock: model for the silos' times (deterministic); wall (time.perf_counter) for the
server's seconds; RSS from psutil. Takes ~15 minutes on 2 cores (--quick: 20 rounds).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from fedlb.experiments import Scenario, markdown_table, run_benchmark, run_policy

SILOS = (5, 10, 20)


def run(silos: int, rounds: int) -> dict[str, Any]:
    scenario = Scenario.from_mapping(
        {
            "name": f"load-{silos}",
            "silos": silos,
            "speeds": f"hetero-4:{silos}",
            "rounds": rounds,
            "local-steps": 5,
            "batch-size": 16,
            "clock": "model",
            "policies": "lb",
        }
    )
    with tempfile.TemporaryDirectory() as folder:  # a checkpoint every round, as a server
        records = run_policy(scenario, "lb", Path(folder)).records
    server_s = [r.server_s for r in records[1:] if r.server_s is not None]  # 1: start-up
    rss = {r.round: r.server_rss_mb for r in records if r.server_rss_mb is not None}
    later = [k for k in sorted(rss) if k >= 10]
    slope = float(np.polyfit(later, [rss[k] for k in later], 1)[0]) if len(later) > 2 else None
    return {
        "silos": silos,
        "rounds": len(records),
        "server_s_mean": statistics.fmean(server_s),
        "server_s_max": max(server_s),
        "server_s_per_silo": statistics.fmean(server_s) / silos,
        "rss_round_10_mb": rss.get(10),
        "rss_last_mb": rss[max(rss)],
        "rss_slope_mb_per_round": slope,
        "efficiency_from_round_3": statistics.fmean(
            r.efficiency for r in records if r.round >= 3 and r.efficiency is not None
        ),
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def server_load(quick: bool, figures: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    rounds = 20 if quick else 100
    results = [run(n, rounds) for n in SILOS]
    rows = [
        [
            str(r["silos"]),
            str(r["rounds"]),
            f"{r['server_s_mean'] * 1000:.1f}",
            f"{r['server_s_max'] * 1000:.1f}",
            f"{r['server_s_per_silo'] * 1000:.2f}",
            f"{r['rss_round_10_mb']:.0f}" if r["rss_round_10_mb"] else "-",
            f"{r['rss_last_mb']:.0f}",
            f"{r['rss_slope_mb_per_round']:+.3f}"
            if r["rss_slope_mb_per_round"] is not None
            else "-",
            f"{r['efficiency_from_round_3']:.3f}",
        ]
        for r in results
    ]
    text = markdown_table(
        [
            "silos",
            "rounds",
            "server ms/round",
            "max ms",
            "ms per silo",
            "RSS round 10 MB",
            "RSS last MB",
            "RSS slope MB/round",
            "E from round 3",
        ],
        rows,
    )
    growth = results[-1]["server_s_mean"] / results[0]["server_s_mean"]
    silos_ratio = SILOS[-1] / SILOS[0]
    text += (
        f"\n\nServer time per round grows {growth:.2f}x from {SILOS[0]} to {SILOS[-1]} silos "
        f"({silos_ratio:.0f}x the silos): {growth / silos_ratio:.2f} of linear. Clock: model "
        "for the silos; wall for the server's seconds; RSS of the server process (psutil)."
    )
    return text, {"load": results, "server_time_growth": growth, "silos_ratio": silos_ratio}


def main() -> None:
    run_benchmark(
        "fedlb server load benchmark",
        __doc__.splitlines()[0],
        "Flower Simulation Engine, model clock for the silos, wall clock for the server.",
        [("Server time and memory per round", server_load)],
    )


if __name__ == "__main__":
    main()
