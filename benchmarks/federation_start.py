"""A federation's start on this machine: a SuperLink and N warm silos, from nothing to every
warm server serving (clock: wall, time.monotonic), with the CPU its process trees spent.

    .venv/bin/python benchmarks/federation_start.py [--silos 3] [--repeats 3]

Run it on two commits to compare launchers (docs/benchmarks.md, "A run's start and end").
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import psutil

from fedlb.deploy.federation import Federation


def tree_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes and everything below them."""
    total = 0.0
    for pid in pids:
        try:
            top = psutil.Process(pid)
            members = [top, *top.children(recursive=True)]
        except psutil.Error:
            continue
        for member in members:
            try:
                times = member.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system + times.children_user + times.children_system
    return total


def one_start(silos: int) -> tuple[float, float, float]:
    """(SuperNodes' APIs up s, every warm server serving s, CPU s) for one fresh start."""
    with tempfile.TemporaryDirectory() as folder:
        started = time.monotonic()
        with Federation(Path(folder) / "procs") as federation:
            configs = {
                f"silo-{i}": {"partition-id": i, "num-partitions": silos, "threads": 1}
                for i in range(silos)
            }
            nodes = federation.add_silos(configs)
            apis_up = time.monotonic() - started
            assert federation.link is not None
            logs = [node.log_path for node in [federation.link, *nodes]]
            while not all("serving" in log.read_text() for log in logs):  # warm: ... serving
                time.sleep(0.05)
            serving = time.monotonic() - started
            cpu = tree_cpu_s([node.pid for node in [federation.link, *nodes]])
    return apis_up, serving, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--silos", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs = []
    for repeat in range(args.repeats):
        apis_up, serving, cpu = one_start(args.silos)
        runs.append((apis_up, serving, cpu))
        print(
            f"start {repeat}: SuperNodes up {apis_up:.2f} s, every warm server serving "
            f"{serving:.2f} s, CPU of the process trees {cpu:.1f} s (clock: wall)",
            flush=True,
        )
    print(
        "median: SuperNodes up {:.2f} s, serving {:.2f} s, CPU {:.1f} s".format(
            *(statistics.median(run[k] for run in runs) for k in range(3))
        )
    )


if __name__ == "__main__":
    main()
