"""The live page in a real headless browser (Debian's chromium) against a live `fedlb
demo`: the page loads, updates as rounds finish, and the figures it draws equal
rounds.jsonl's. The page's script renders every figure into the DOM (the rounds table's
data-* attributes), which chromium's --dump-dom reads back at two moments of the run.

A token-protected page (--page-host, --page-token) on another address than 127.0.0.1
(127.0.0.2: Linux answers all of 127.0.0.0/8 on loopback) opened with the printed address
shows its rounds: the token in that address is the only one the browser is given; the
page's scripts, chart library and data come with the cookie its first answer set."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

BROWSERS = ("chromium", "chromium-browser")
TOKEN = "live-page-token-of-some-length"
ANOTHER = "127.0.0.2"  # another address of this machine than 127.0.0.1
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


def another_address() -> str:
    """127.0.0.2 where this machine listens on it (Linux: all of 127.0.0.0/8), else a skip
    saying so (macOS has 127.0.0.1 only unless an alias is added)."""
    with socket.socket() as probe:
        try:
            probe.bind((ANOTHER, 0))
        except OSError as error:
            pytest.skip(
                f"cannot listen on {ANOTHER} ({error.strerror}): the token-protected page's "
                f"browser test opens it from another address than 127.0.0.1 "
                f"(macOS: `sudo ifconfig lo0 alias {ANOTHER}`)"
            )
    return ANOTHER


class Rows(HTMLParser):
    """The <tr data-round ...> rows of the page: rounds, and silos' rounds (data-silo)."""

    def __init__(self) -> None:
        super().__init__()
        self.rounds: dict[int, dict[str, str]] = {}
        self.silos: dict[tuple[int, str], dict[str, str]] = {}
        self.body: dict[str, str] = {}
        self.text = ""  # the DOM as chromium dumped it

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
    rows.text = done.stdout
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


def some_rounds(path: Path, count: int) -> None:
    """A run's rounds.jsonl with `count` rounds of 3 silos (their B moving, as balanced)."""
    from fedlb.flower import RoundRecord
    from fedlb.flower.records import SiloRound

    lines = []
    for number in range(1, count + 1):
        silos = [
            SiloRound(
                f"silo-{i}",
                1000 + i,
                16 + number * (i - 1),
                5,
                0.25 * (i + 1),
                0.05,
                0.4 * (i + 1),
                0.1 * (2 - i),
                2.3 - 0.1 * number,
                100,
                0.0,
                16 + (number + 1) * (i - 1),
                start_s=0.1,
                wall_s=1.0 + 0.1 * i,
            )
            for i in range(3)
        ]
        accuracy = {"accuracy": 0.1 * number, "loss": 2.0 - 0.1 * number}
        lines += RoundRecord(
            number, "measured", silos, 1.2, 0.9, 0.75, 0.2, 1.5, **accuracy
        ).json_lines()
    path.write_text("".join(line + "\n" for line in lines))


def check_drawn(rows: Rows, recorded: dict[int, list[dict]]) -> None:
    """Every round on file drawn, with its figures, and the charts drawn (the page's
    script ran to its end: uPlot loaded)."""
    check_figures(rows, recorded)
    assert sorted(rows.rounds) == sorted(recorded)
    assert rows.body["data-status"] != "loading"
    assert int(rows.body["data-rounds"]) == len(recorded)
    assert 'class="uplot' in rows.text  # the chart library came too


@pytest.mark.slow
def test_a_token_protected_page_on_another_address_shows_its_rounds_in_a_browser(tmp_path):
    """The probe's case: a page with a token on another address than 127.0.0.1 serving a
    run's 8 rounds (a resumed server's page starts with them), opened with its printed
    address: chromium shows the rounds, not "loading". Without the token it is told, in
    one line, to open the printed address."""
    from fedlb.cli.federation import page_rounds_before
    from fedlb.page import LivePage, PageState

    chromium = browser()
    host = another_address()
    some_rounds(tmp_path / "rounds.jsonl", 8)
    state = PageState()
    state.start_run("fedlb server", out_dir=str(tmp_path), num_rounds=10, num_silos=3)
    page_rounds_before(state, tmp_path / "rounds.jsonl")
    with LivePage(state, host, token=TOKEN) as page:
        assert page.url == f"http://{host}:{page.port}/?token={TOKEN}"
        shown = dump(chromium, page.url, tmp_path / "profile")
        check_drawn(shown, rounds_in(tmp_path / "rounds.jsonl"))
        assert len(shown.rounds) == 8
        assert shown.body["data-status"] == "running"
        refused = dump(chromium, f"http://{host}:{page.port}/", tmp_path / "other-profile")
    assert not refused.rounds
    assert "open the address fedlb printed" in refused.text
    assert TOKEN not in refused.text


@pytest.mark.slow
def test_fedlb_demo_with_page_host_and_page_token_shows_its_rounds_in_a_browser(tmp_path):
    """Issue 51's "done when": `fedlb demo --page-host 127.0.0.2 --page-token T`, its page
    opened in chromium with the address it printed, shows the rounds as rounds.jsonl has
    them; the token is in that printed address and in nothing else it writes."""
    chromium = browser()
    host = another_address()
    out = tmp_path / "out"
    log_path = tmp_path / "demo.log"
    log = log_path.open("w")  # a file: a full pipe would stall the demo
    demo = subprocess.Popen(
        [
            *(sys.executable, "-m", "fedlb.cli", "demo", "--num-rounds", "12"),
            *("--local-steps", "8", "--out-dir", str(out)),
            *("--page-host", host, "--page-token", TOKEN),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        printed = None
        while printed is None or len(rounds_in(out / "rounds.jsonl")) < 3:
            assert demo.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, "the demo's page or rounds did not come"
            if printed is None:
                found = re.search(
                    r"live page: (http://\S+)", " ".join(log_path.read_text().split())
                )
                printed = found.group(1) if found else None
            time.sleep(0.2)
        assert printed.startswith(f"http://{host}:")
        assert printed.endswith(f"/?token={TOKEN}")
        time.sleep(1.5)  # the demo reads rounds.jsonl every second or so
        shown = dump(chromium, printed, tmp_path / "profile")
        assert demo.poll() is None, "the demo ended before the look: make it longer"
        recorded = rounds_in(out / "rounds.jsonl")
        check_figures(shown, recorded)
        assert len(shown.rounds) >= 3
        assert shown.body["data-status"] == "running"
        assert 'class="uplot' in shown.text
    finally:
        if demo.poll() is None:
            demo.terminate()  # SIGTERM: the demo stops everything it started
            demo.wait(60)
        log.close()
    said = log_path.read_text()
    assert said.count(TOKEN) == 1, said[-4000:]  # the printed address only
    for written in out.rglob("*"):
        if written.is_file():
            assert TOKEN.encode() not in written.read_bytes(), written
