"""The live page in a real headless browser (Debian's chromium) against a live `fedlb
demo`: the page loads, updates as rounds finish, and the figures it draws equal
rounds.jsonl's. The page's script renders every figure into the DOM (the rounds table's
data-* attributes), which chromium's --dump-dom reads back at two moments of the run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

BROWSERS = ("chromium", "chromium-browser")
ROUND_FIELDS = (
    "wall_s",
    "round_s",
    "ideal_s",
    "efficiency",
    "idle_fraction",
    "accuracy",
    "loss",
    "server_accuracy",
    "server_loss",
)
SILO_FIELDS = (
    "batch_size",
    "next_batch_size",
    "compute_s",
    "fixed_s",
    "idle_s",
    "start_s",
    "wall_s",
)


def browser() -> str:
    found = next((shutil.which(name) for name in BROWSERS if shutil.which(name)), None)
    if found is None:
        pytest.skip(
            "no chromium on PATH (looked for chromium, chromium-browser): the live page's "
            "browser test needs Debian's chromium: `apt-get install -y chromium` as root "
            "(./scripts/setup.sh does it where it runs as root with apt)"
        )
    return found


class Rows(HTMLParser):
    """The <tr data-round ...> rows of the page: rounds, and silos' rounds (data-silo)."""

    def __init__(self) -> None:
        super().__init__()
        self.rounds: dict[int, dict[str, str]] = {}
        self.silos: dict[tuple[int, str], dict[str, str]] = {}
        self.body: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {k: v or "" for k, v in attrs}
        if tag == "body":
            self.body = values
        if tag != "tr" or "data-round" not in values:
            return
        number = int(values["data-round"])
        if "data-silo" in values:
            self.silos[(number, values["data-silo"])] = values
        else:
            self.rounds[number] = values


def dump(chromium: str, url: str, profile: Path) -> Rows:
    done = subprocess.run(
        [
            chromium,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            f"--user-data-dir={profile}",
            "--virtual-time-budget=4000",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = Rows()
    rows.feed(done.stdout)
    return rows


def same(shown: str, value: float | int | None) -> bool:
    """A figure as the page wrote it (JS's shortest round-trip text) against the file's."""
    if value is None:
        return shown == ""
    return shown != "" and float(shown) == pytest.approx(value, rel=1e-12, abs=1e-12)


def rounds_in(path: Path) -> dict[int, list[dict]]:
    found: dict[int, list[dict]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                found.setdefault(row["round"], []).append(row)
    return {k: v for k, v in found.items() if len(v) == v[0]["round_silos"]}


def check_figures(rows: Rows, recorded: dict[int, list[dict]]) -> None:
    assert rows.rounds, "the page drew no round"
    for number, shown in rows.rounds.items():
        lines = recorded[number]  # every round drawn is on file
        for field in ROUND_FIELDS:
            attr = "data-" + field.replace("_", "-")
            assert same(shown[attr], lines[0][field]), (number, field, shown[attr])
        for line in lines:
            silo = rows.silos[(number, line["silo"])]
            for field in SILO_FIELDS:
                key = f"silo_{field}" if f"silo_{field}" in line else field
                attr = "data-" + field.replace("_", "-")
                assert same(silo[attr], line[key]), (number, line["silo"], field, silo[attr])


@pytest.mark.slow
def test_the_live_page_follows_a_demo_in_a_real_browser(tmp_path):
    from fedlb.deploy.processes import free_port

    chromium = browser()
    port = free_port()
    out = tmp_path / "out"
    url = f"http://127.0.0.1:{port}/"
    log = (tmp_path / "demo.log").open("w")  # a file: a full pipe would stall the demo
    demo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fedlb.cli",
            "demo",
            "--num-rounds",
            "12",
            "--local-steps",
            "8",
            "--out-dir",
            str(out),
            "--page-port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240

        def wait_for(count: int) -> None:
            while len(rounds_in(out / "rounds.jsonl")) < count:
                assert demo.poll() is None, (tmp_path / "demo.log").read_text()[-4000:]
                assert time.monotonic() < deadline, "the demo's rounds did not come"
                time.sleep(0.2)

        wait_for(1)
        first = dump(chromium, url, tmp_path / "profile")
        check_figures(first, rounds_in(out / "rounds.jsonl"))
        assert first.body["data-status"] == "running"
        drawn = len(first.rounds)
        wait_for(drawn + 2)
        time.sleep(1.5)  # the demo reads rounds.jsonl every second or so; the page polls
        second = dump(chromium, url, tmp_path / "profile")
        assert demo.poll() is None, "the demo ended before the second look: make it longer"
        check_figures(second, rounds_in(out / "rounds.jsonl"))
        assert len(second.rounds) > drawn, "the page did not update as rounds finished"
        assert int(second.body["data-rounds"]) == len(second.rounds)
        assert demo.wait(timeout=240) == 0
        said = (tmp_path / "demo.log").read_text()
        assert f"live page: {url}" in " ".join(said.split())
    finally:
        if demo.poll() is None:
            demo.terminate()
            demo.wait(30)
        log.close()
