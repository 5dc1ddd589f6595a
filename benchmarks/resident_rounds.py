"""A warm silo's per-round fixed cost with a resident worker and with a fork per message
(fedlb.deploy.resident), side by side in one federation on this machine: silo-0 runs its
ClientApps in a resident worker, silo-1 in a fork each, the same data size and speed.

    .venv/bin/python benchmarks/resident_rounds.py [--rounds 8] [--model cnn]

Per round and silo: the ClientApp's start-up before training (start_s: the task handed
over -> the app's handler), the silo's fixed cost (fixed_s: what does not scale with
the batch) and the server's wall from the train message pushed to the reply in, minus
the silo's busy time (wall_s - round_s: framework, transfers, start-up). Clock: wall
(time.time / perf_counter). Round 1 is each worker's first task: shown, and left out of
the medians. On a CPU there is no CUDA context to keep: what is left to save is the
fork, the model's construction and the child's first backward.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from fedlb.deploy import RunConfig
from fedlb.deploy.federation import Federation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--model", default="cnn")
    args = parser.parse_args()
    silo = {"num-partitions": 2, "threads": 1}
    with (
        tempfile.TemporaryDirectory() as folder,
        Federation(Path(folder) / "procs") as federation,
    ):
        federation.add_silos({"silo-0": {**silo, "partition-id": 0}}, resident="on")
        federation.add_silos({"silo-1": {**silo, "partition-id": 1}}, resident="off")
        settings = {
            **RunConfig().to_mapping(),
            "num-silos": 2,
            "num-rounds": args.rounds,
            "model": args.model,
            "local-steps": 5,
            "batch-size": 16,
            "evaluate-every": args.rounds,
            "out-dir": str(Path(folder) / "out"),
        }
        outcome = federation.run(settings, timeout=600)
    assert outcome.status == "finished:completed", outcome.problem
    columns: dict[str, dict[str, list[float]]] = {}
    print("round silo     start_s fixed_s wall-busy_s")
    for record in outcome.records:
        for s in sorted(record.silos, key=lambda s: s.silo):
            overhead = (s.wall_s or 0.0) - s.round_s
            print(
                f"{record.round:5d} {s.silo:8s} {s.start_s or 0.0:7.3f} {s.fixed_s:7.3f} "
                f"{overhead:11.3f}"
            )
            if record.round > 1:
                mine = columns.setdefault(s.silo, {"start": [], "fixed": [], "overhead": []})
                mine["start"].append(s.start_s or 0.0)
                mine["fixed"].append(s.fixed_s)
                mine["overhead"].append(overhead)
    for name, kind in (("silo-0", "resident worker"), ("silo-1", "fork per message")):
        medians = {key: statistics.median(values) for key, values in columns[name].items()}
        print(
            f"{name} ({kind}), median of rounds 2-{args.rounds}: start-up "
            f"{medians['start'] * 1000:.1f} ms, fixed {medians['fixed'] * 1000:.1f} ms, "
            f"wall - busy {medians['overhead'] * 1000:.1f} ms (clock: wall)"
        )


if __name__ == "__main__":
    main()
