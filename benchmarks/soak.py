"""Soak on real processes: a federation whose silos and server keep dying, run to the end.

`fedlb server` and three `fedlb silo` processes on 127.0.0.1 (digits, MLP, emulated
speeds 1x/2x/3x), 30 rounds. Every 5 checkpointed rounds, a few seconds into the next
round (mid-training), one silo is hit: in turn, its `fedlb silo` process is SIGKILLed
alone (what it started must die with it) and started again for the same partition, or
its warm ClientApp server is SIGKILLed (its launcher must restart it, and the message in
flight must fail at once). Once, after round 12, `fedlb server` is SIGKILLed alone and
`fedlb server --resume` takes over. At the end it checks what an operator needs:

- the run completes and the resumed server exits 0;
- every round is in rounds.jsonl exactly once, and no partition counts twice in a round;
- no process that fedlb started (or that Flower started under it) is left;
- no console (the servers', the silos') shows a traceback;

and reports the rounds lost to timeouts (none expected: a killed silo's node is declared
gone after ~20 s of missed heartbeats, a lost task fails at once; the round timeout is
ROUND_TIMEOUT), rounds without a silo, and wall time.

    .venv/bin/python benchmarks/soak.py [--rounds 30] [--json soak.json]

Clock: wall (time.monotonic) for the run; silos' speeds emulated (sleep-padded).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from fedlb.deploy.processes import free_port
from fedlb.deploy.warm import SERVER_NAME
from fedlb.deploy.warm_tasks import TASK_NAME
from fedlb.flower import load_checkpoint

FEDLB = [sys.executable, "-m", "fedlb.cli"]
SILOS = 3
ROUND_TIMEOUT = 120.0  # a round that needs it has lost a silo without Flower noticing
MID_ROUND_S = 4.0  # a silo is killed this long after a round's checkpoint: mid-round


class Soak:
    def __init__(self, work: Path, rounds: int) -> None:
        self.work = work
        self.rounds = rounds
        self.port = free_port()
        self.out = work / "out"
        self.silos: dict[int, subprocess.Popen[bytes]] = {}
        self.seen: dict[int, float] = {}  # every process started below us: pid -> start
        self.events: list[str] = []
        self.started = time.monotonic()

    def log(self, text: str) -> None:
        line = f"[{time.monotonic() - self.started:6.1f} s] {text}"
        self.events.append(line)
        print(line, flush=True)

    def start_silo(self, i: int) -> None:
        log = (self.work / f"silo-{i}.out").open("ab")
        self.silos[i] = subprocess.Popen(
            [
                *FEDLB,
                "silo",
                "--server",
                f"127.0.0.1:{self.port}",
                "--partition-id",
                str(i),
                "--num-partitions",
                str(SILOS),
                "--slowdown",
                str(1 + i),
                "--threads",
                "1",
                "--workdir",
                str(self.work / f"silo-{i}"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def start_server(self, resume: bool) -> subprocess.Popen[bytes]:
        args = (
            ["--resume", str(self.out)]
            if resume
            else [
                "--port",
                str(self.port),
                "--out-dir",
                str(self.out),
                "--num-silos",
                str(SILOS),
                "--num-rounds",
                str(self.rounds),
                "--local-steps",
                "5",
                "--batch-size",
                "16",
                "--round-timeout",
                str(ROUND_TIMEOUT),
                "--evaluate-every",
                "5",
            ]
        )
        log = (self.work / f"server-{'resumed' if resume else 'first'}.out").open("ab")
        return subprocess.Popen(
            [*FEDLB, "server", *args, "--run-timeout", "1500"],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_listening(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), 1),
            ):
                return
            time.sleep(0.2)

    def note_processes(self, roots: list[subprocess.Popen[bytes]]) -> None:
        for root in roots:
            with contextlib.suppress(psutil.Error):
                for p in [psutil.Process(root.pid), *psutil.Process(root.pid).children(True)]:
                    with contextlib.suppress(psutil.Error):
                        self.seen[p.pid] = p.create_time()

    def left_over(self) -> list[str]:
        left = []
        for pid, started in self.seen.items():
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{pid} {' '.join(p.cmdline())[:120]}")
        return left

    def warm_server(self, i: int, busy_within: float = 0.0) -> psutil.Process | None:
        """Silo i's warm ClientApp server (fedlb.deploy.warm), if it runs now; waiting up
        to `busy_within` s for it to run a task (a forked ClientApp) and 0.5 s into it."""
        deadline = time.monotonic() + busy_within
        while True:
            server = None
            with contextlib.suppress(psutil.Error):
                for p in psutil.Process(self.silos[i].pid).children(True):
                    with contextlib.suppress(psutil.Error):
                        if p.name() == SERVER_NAME:
                            server = p
            with contextlib.suppress(psutil.Error):
                if server is not None and any(c.name() == TASK_NAME for c in server.children()):
                    time.sleep(0.5)
                    return server
            if time.monotonic() >= deadline:
                return server
            time.sleep(0.02)

    def tracebacks(self) -> dict[str, str]:
        """Each console (the .out files) that shows a traceback, with its last lines."""
        found = {}
        for console in sorted(self.work.glob("*.out")):
            text = console.read_text(errors="replace")
            if "Traceback" in text:
                found[console.name] = text[text.index("Traceback") :][:2000]
        return found

    def checkpointed(self) -> int:
        try:
            return load_checkpoint(self.out).round
        except Exception:  # not written yet, or being replaced
            return 0

    def run(self) -> dict[str, Any]:
        server = self.start_server(resume=False)
        self.wait_listening()  # before silos pick free ports for their SuperNodes' own APIs
        for i in range(SILOS):
            self.start_silo(i)
        self.log(f"server (pid {server.pid}) and {SILOS} silos started")
        killed_at: set[int] = set()
        server_killed = False
        deadline = time.monotonic() + 1500
        while server.poll() is None and time.monotonic() < deadline:
            self.note_processes([server, *self.silos.values()])
            done = self.checkpointed()
            due = done // 5 * 5
            if due and due not in killed_at and done < self.rounds:
                killed_at.add(due)
                victim = (due // 5 - 1) % SILOS
                time.sleep(MID_ROUND_S)  # into the next round's training
                if due // 5 % 2:
                    self.silos[victim].kill()  # `fedlb silo` alone
                    self.silos[victim].wait()
                    self.log(
                        f"{MID_ROUND_S:.0f} s after round {done}: SIGKILL fedlb silo "
                        f"{victim}; started again"
                    )
                    self.start_silo(victim)
                else:
                    warm = self.warm_server(victim, busy_within=30.0)
                    if warm is not None:
                        warm.kill()  # mid-task; the launcher restarts it
                    which = f"pid {warm.pid}" if warm is not None else "not found"
                    self.log(
                        f"{MID_ROUND_S:.0f} s after round {done}: SIGKILL silo {victim}'s "
                        f"warm ClientApp server ({which})"
                    )
            if not server_killed and done >= 12:
                server_killed = True
                server.kill()  # `fedlb server` alone
                server.wait()
                self.log(f"after round {done}: SIGKILL fedlb server; resuming")
                server = self.start_server(resume=True)
            time.sleep(0.5)
        if server.poll() is None:
            server.kill()
            self.log("gave up: the run did not end in 1500 s")
        wall = time.monotonic() - self.started
        self.log(f"server exited with {server.returncode}")
        for silo in self.silos.values():
            silo.send_signal(signal.SIGTERM)
        for silo in self.silos.values():
            silo.wait(60)
        time.sleep(2)  # the guards' own stop
        return self.verdict(server.returncode, wall)

    def verdict(self, returncode: int | None, wall: float) -> dict[str, Any]:
        rows = [json.loads(line) for line in (self.out / "rounds.jsonl").read_text().splitlines()]
        by_round: dict[int, dict[str, Any]] = {}
        for row in rows:
            entry = by_round.setdefault(
                row["round"], {"silos": [], "failed": row.get("failed", []), "wall": 0.0}
            )
            entry["wall"] = row.get("wall_s", 0.0)
            if "silo" in row:
                entry["silos"].append(row["silo"])
        timeouts = {k: v for k, v in by_round.items() if any("timeout" in f for f in v["failed"])}
        result = {
            "rounds": self.rounds,
            "exit_code": returncode,
            "rounds_on_record": sorted(by_round),
            "every_round_once": sorted(by_round) == list(range(1, self.rounds + 1))
            and len(rows) == sum(max(1, len(v["silos"])) for v in by_round.values()),
            "partition_counted_twice": [
                k for k, v in by_round.items() if len(v["silos"]) != len(set(v["silos"]))
            ],
            "rounds_lost_to_timeouts": sorted(timeouts),
            "seconds_in_those_rounds": round(sum(v["wall"] for v in timeouts.values()), 1),
            "rounds_without_a_silo": [k for k, v in by_round.items() if not v["silos"]],
            "rounds_short_of_silos": {
                k: v["failed"] for k, v in by_round.items() if 0 < len(v["silos"]) < SILOS
            },
            "processes_left": self.left_over(),
            "tracebacks_on_consoles": self.tracebacks(),
            "processes_seen": len(self.seen),
            "wall_s": round(wall, 1),
            "clock": "wall (time.monotonic); silo speeds emulated (sleep-padded)",
            "events": self.events,
        }
        result["ok"] = (
            returncode == 0
            and result["every_round_once"]
            and not result["partition_counted_twice"]
            and not result["processes_left"]
            and not result["tracebacks_on_consoles"]
            and not result["rounds_lost_to_timeouts"]
        )
        return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="fedlb-soak-"))
    result = Soak(folder, args.rounds).run()
    if result["ok"]:
        shutil.rmtree(folder, ignore_errors=True)
    else:
        print(f"logs kept in {folder}")
    for key, value in result.items():
        if key != "events":
            print(f"{key}: {value}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
        print(f"results: {args.json}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
