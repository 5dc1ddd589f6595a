"""What the live page costs a round: the same short `fedlb demo` without the page, with
it, with it and an HTTP client polling its whole data four times a second (a worst case:
the page itself asks once a second, for the version only between rounds), and with it open in
a headless chromium (its script polling and redrawing every second), side by side in one
run (clock: wall, the ServerApp's round wall: train and evaluation phases). Beside it,
the CPU seconds of the `fedlb demo` process itself (the page's thread runs there, not in
the ServerApp) per round: what the page costs when the machine is shared and the walls
are noisy.

    .venv/bin/python benchmarks/live_page.py [--rounds 10] [--local-steps 10] [--repeats 2]

Each variant runs `--repeats` times, the order reversed every other repeat so that a
drift of the machine falls on all of them. A round's wall is rounds.jsonl's wall_s +
eval_wall_s; rounds 2..R-1 are kept (round 1 pays the silos' start, the last the final
evaluation), pooled over the repeats; the table gives their median and its ratio to the
run without the page. The browser variant is left out, saying so, without chromium.
Takes ~4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from fedlb.deploy.processes import free_port

VARIANTS = ("no page", "page", "page + poller", "page + browser")
POLL_EVERY_S = 0.25


@contextlib.contextmanager
def every(period_s: float, step: Callable[[], None]) -> Iterator[None]:
    """`step()` on a thread every `period_s` while the block runs."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            step()
            stop.wait(period_s)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


@contextlib.contextmanager
def poller(url: str) -> Iterator[list[float]]:
    """GET the page's data every POLL_EVERY_S while the block runs; the seconds each took."""
    took: list[float] = []

    def get() -> None:
        started = time.perf_counter()
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url + "api/state", timeout=5) as answer:
                answer.read()
            took.append(time.perf_counter() - started)

    with every(POLL_EVERY_S, get):
        yield took


@contextlib.contextmanager
def cpu_of(pid: int) -> Iterator[list[float]]:
    """The process's own CPU seconds (user + system, its children not included), read
    every 0.2 s while the block runs: the last reading is its total before it ended."""
    last: list[float] = [0.0]
    process = psutil.Process(pid)

    def read() -> None:
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            last[0] = times.user + times.system

    with every(0.2, read):
        yield last


@contextlib.contextmanager
def browser(chromium: str, url: str, profile: Path) -> Iterator[None]:
    """The page open in a headless chromium (its script polls and redraws every second)."""
    process = subprocess.Popen(
        [
            chromium,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            f"--user-data-dir={profile}",
            "--remote-debugging-port=0",  # keeps it running with the page open
            url,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def run_demo(
    variant: str, out: Path, args: argparse.Namespace, chromium: str | None
) -> dict[str, Any]:
    """One `fedlb demo` as `variant`; its middle rounds' walls and the client's latencies."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    command = [
        sys.executable,
        "-m",
        "fedlb.cli",
        "demo",
        "--num-rounds",
        str(args.rounds),
        "--local-steps",
        str(args.local_steps),
        "--out-dir",
        str(out),
        *(["--no-page"] if variant == "no page" else ["--page-port", str(port)]),
    ]
    log = (out.parent / f"{out.name}.log").open("w")
    demo = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    took: list[float] = []
    with contextlib.ExitStack() as stack:
        cpu = stack.enter_context(cpu_of(demo.pid))
        if variant != "no page":
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and demo.poll() is None:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
                    break
                time.sleep(0.1)
        if variant == "page + poller":
            took = stack.enter_context(poller(url))
        if variant == "page + browser" and chromium is not None:
            stack.enter_context(browser(chromium, url, out.parent / f"{out.name}-profile"))
        code = demo.wait(600)
    log.close()
    if code != 0:
        raise SystemExit(f"{variant}: fedlb demo exited {code}; see {log.name}")
    rows = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    walls = {r["round"]: r["wall_s"] + (r["eval_wall_s"] or 0.0) for r in rows}
    last = max(walls)
    return {
        "walls": [w for k, w in sorted(walls.items()) if 1 < k < last],
        "cpu_ms_per_round": 1000 * cpu[0] / len(walls),
        "requests": len(took),
        "request_ms": 1000 * statistics.median(took) if took else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--local-steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    variants = [v for v in VARIANTS if v != "page + browser" or chromium]
    if chromium is None:
        print("no chromium on PATH: the 'page + browser' variant is left out")
    walls: dict[str, list[float]] = {v: [] for v in variants}
    requests: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="fedlb-live-page-") as folder:
        for repeat in range(args.repeats):
            order = variants if repeat % 2 == 0 else variants[::-1]
            for variant in order:
                name = f"{repeat}-{variant.replace(' ', '').replace('+', '-')}"
                result = run_demo(variant, Path(folder) / name, args, chromium)
                walls[variant] += result["walls"]
                cpu[variant].append(result["cpu_ms_per_round"])
                if result["request_ms"] is not None:
                    requests[variant].append(result["request_ms"])
                print(
                    f"repeat {repeat + 1}, {variant}: round wall median "
                    f"{statistics.median(result['walls']):.3f} s over {len(result['walls'])} rounds"
                    f"; fedlb demo's own CPU {result['cpu_ms_per_round']:.0f} ms a round"
                    + (
                        f"; {result['requests']} requests, median {result['request_ms']:.1f} ms"
                        if result["request_ms"] is not None
                        else ""
                    ),
                    flush=True,
                )
    base = statistics.median(walls["no page"])
    print(
        f"\nfedlb demo --num-rounds {args.rounds} --local-steps {args.local_steps} (3 silos, "
        f"slowdowns 1,2,4), {args.repeats} runs each; rounds 2..{args.rounds - 1}; clock: wall"
    )
    print(
        f"{'variant':<16}{'rounds':>7}{'median s':>10}{'min s':>8}{'max s':>8}{'ratio':>7}"
        f"{'CLI CPU ms/round':>18}"
    )
    figures = {}
    for variant in variants:
        median = statistics.median(walls[variant])
        figures[variant] = {
            "rounds": len(walls[variant]),
            "median_s": median,
            "min_s": min(walls[variant]),
            "max_s": max(walls[variant]),
            "ratio": median / base,
            "request_ms": statistics.median(requests[variant]) if requests[variant] else None,
            "cli_cpu_ms_per_round": statistics.mean(cpu[variant]),
        }
        print(
            f"{variant:<16}{len(walls[variant]):>7}{median:>10.3f}{min(walls[variant]):>8.3f}"
            f"{max(walls[variant]):>8.3f}{median / base:>7.3f}"
            f"{statistics.mean(cpu[variant]):>18.0f}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
