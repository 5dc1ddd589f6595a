"""The live page (fedlb.page): its state from round records, its JSON and its safety
(loopback only by default, a token for anywhere else); in-process, no browser."""

from __future__ import annotations

import json
import math
import urllib.request

import pytest
from starlette.testclient import TestClient

from fedlb.flower import RoundRecord
from fedlb.flower.records import SiloRound
from fedlb.page import LivePage, PageError, PageState, check_binding, is_loopback, make_app

TOKEN = "a-secret-of-some-length"


def record(number: int, silos: tuple[str, ...] = ("silo-0", "silo-1"), **fields) -> RoundRecord:
    rows = [
        SiloRound(
            label,
            2**63 + i,
            16 * (i + 1),
            5,
            0.5,
            0.1,
            0.6,
            0.2,
            2.3,
            100,
            0.0,
            16,
            start_s=0.1,
            wall_s=1.0,
        )
        for i, label in enumerate(silos)
    ]
    values = {"accuracy": 0.1 * number, "server_accuracy": math.nan, **fields}
    return RoundRecord(number, "measured", rows, 0.8, 0.6, 0.75, 0.25, 1.2, **values)


def test_the_state_holds_rounds_silos_and_events_as_json():
    state = PageState()
    state.start_run(
        "fedlb demo",
        address="127.0.0.1:1",
        num_rounds=4,
        num_silos=3,
        local_silos=[("silo-2", "emulated 50 samples/s")],
    )
    state.add_round(record(1))
    state.add_round(
        record(2, ("silo-0",), failed=["silo-1: no reply in 60 s"], events=["silo-1 left"])
    )
    shot = json.loads(json.dumps(state.snapshot(), allow_nan=False))  # NaN became null
    assert [r["round"] for r in shot["rounds"]] == [1, 2]
    assert shot["rounds"][0]["server_accuracy"] is None
    silos = {s["silo"]: s for s in shot["silos"]}
    assert silos["silo-1"]["missed"] == 1
    assert silos["silo-1"]["missed_rounds"] == [2]
    assert silos["silo-1"]["last_round"] == 1
    assert silos["silo-0"]["node"] == f"node-{2**63}"  # text: more than a JS number holds
    assert silos["silo-2"]["device"] == "emulated 50 samples/s"  # announced, not seen yet
    assert shot["current"] == {
        "round": 3,
        "running": True,
        "in_flight": None,  # no out-dir, no progress file
        "last_round": 2,
        "replied": ["silo-0"],
        "failed": ["silo-1"],
    }
    kinds = [(e["round"], e["kind"]) for e in shot["events"]]
    assert kinds == [(2, "no update"), (2, "event")]
    state.finish("completed")
    assert state.snapshot()["current"]["running"] is False


def test_a_resumed_round_replaces_the_one_it_runs_again():
    state = PageState()
    state.start_run("run", num_rounds=3)
    for number in (1, 2, 2, 3):
        state.add_round(record(number))
    assert [r["round"] for r in state.snapshot()["rounds"]] == [1, 2, 3]


def test_an_experiments_policies_each_get_their_accuracy_against_the_clock():
    state = PageState()
    state.start_run("fedlb experiment x", num_rounds=2)
    for policy in ("fedavg", "fedlb"):
        state.start_policy(policy)
        state.add_round(record(1, server_accuracy=None))
        state.add_round(record(2, server_accuracy=None))
    shot = state.snapshot()
    assert shot["policies"]["fedlb"] == [[0.8, 0.1], [1.6, 0.2]]
    assert shot["run"]["name"] == "fedlb experiment x: fedlb"


def test_the_app_serves_the_page_its_data_and_the_vendored_chart_library():
    state = PageState()
    state.add_round(record(1))
    client = TestClient(make_app(state))
    page = client.get("/")
    assert page.status_code == 200
    assert "page.js" in page.text
    assert client.get("/api/state").json()["rounds"][0]["round"] == 1
    assert client.get("/static/vendor/uPlot.iife.min.js").status_code == 200
    assert client.get("/static/vendor/uPlot-LICENSE").status_code == 200
    assert client.post("/api/state").status_code == 405  # read-only
    # loopback answers loopback's names only: a rebound DNS name gets nothing
    assert client.get("/", headers={"host": "evil.example"}).status_code == 400


def test_a_token_is_required_on_every_request_once_given():
    app = make_app(PageState(), token=TOKEN, loopback=False)
    for path in ("/", "/api/state", "/static/page.js"):
        # a fresh client each time: none has the cookie a right ?token= sets
        assert TestClient(app).get(path).status_code == 401
        wrong = TestClient(app).get(path, params={"token": "wrong-token-here"})
        assert wrong.status_code == 401
        assert TestClient(app).get(path, params={"token": TOKEN}).status_code == 200
    bearer = {"authorization": f"Bearer {TOKEN}"}
    assert TestClient(app).get("/api/state", headers=bearer).status_code == 200
    assert (
        TestClient(app).get("/api/state", headers={"authorization": "Bearer no"}).status_code == 401
    )


def test_a_request_without_the_token_is_told_in_one_line_to_open_the_printed_address():
    answer = TestClient(make_app(PageState(), token=TOKEN, loopback=False)).get("/static/page.js")
    assert answer.status_code == 401
    assert answer.text.count("\n") == 1
    assert answer.text.endswith("\n")
    assert "open the address fedlb printed" in answer.text
    assert TOKEN not in answer.text
    assert answer.headers["www-authenticate"].startswith("Bearer")
    assert answer.headers["cache-control"] == "no-store"


def test_the_printed_addresss_token_becomes_a_cookie_for_the_pages_own_requests():
    """A browser gets the token once (the printed address's ?token=); index.html then
    loads page.js and uPlot, and page.js polls api/state, without it: the answer to the
    first request set a cookie that carries it (HttpOnly, SameSite=Strict, the page's
    path, not Secure on plain http), holding a value derived from the token."""
    app = make_app(PageState(), token=TOKEN, loopback=False)
    browser = TestClient(app)  # keeps cookies as a browser does
    first = browser.get("/", params={"token": TOKEN})
    assert first.status_code == 200
    assert first.headers["referrer-policy"] == "no-referrer"
    assert first.headers["cache-control"] == "no-store"
    said = first.headers["set-cookie"]
    name, value = said.split(";", 1)[0].split("=", 1)
    assert name == "fedlb-page-80"  # one per port: TestClient's server is testserver:80
    assert len(value) == 64
    assert TOKEN not in said
    attributes = {part.strip().lower() for part in said.split(";")[1:]}
    assert attributes == {"httponly", "path=/", "samesite=strict"}  # a session cookie
    for path in ("/static/page.js", "/static/vendor/uPlot.iife.min.js", "/api/state"):
        again = browser.get(path)  # no token in the address: the cookie carries it
        assert again.status_code == 200, path
        assert "set-cookie" not in again.headers  # set once, by the ?token= answer
    # the cookie is the token's: a made-up one, or another port's, gets nothing
    for cookies in ({name: "0" * 64}, {name: ""}, {"fedlb-page-81": value}):
        assert TestClient(app, cookies=cookies).get("/api/state").status_code == 401
    # a wrong ?token= does not undo a right cookie, nor set one
    kept = browser.get("/", params={"token": "wrong-token-here"})
    assert kept.status_code == 200
    assert "set-cookie" not in kept.headers
    # Bearer (a script's way) sets no cookie; nor does a page without a token
    bearer = TestClient(app).get("/api/state", headers={"authorization": f"Bearer {TOKEN}"})
    assert "set-cookie" not in bearer.headers
    assert "set-cookie" not in TestClient(make_app(PageState())).get("/").headers
    # behind a TLS proxy (https as the server sees it) the cookie is Secure too
    tls = TestClient(app, base_url="https://testserver").get("/", params={"token": TOKEN})
    assert "secure" in tls.headers["set-cookie"].lower()


def test_a_page_on_another_loopback_address_answers_its_own_host_name():
    """--page-host 127.0.0.2 (loopback, so the Host check stays): its own address is a
    Host it answers, with its token; a rebound DNS name still gets nothing."""
    app = make_app(PageState(), token=TOKEN, loopback=True, host="127.0.0.2")
    client = TestClient(app)
    ours = client.get("/", params={"token": TOKEN}, headers={"host": "127.0.0.2:8050"})
    assert ours.status_code == 200
    assert client.get("/", headers={"host": "evil.example:8050"}).status_code == 400
    six = make_app(PageState(), token=TOKEN, loopback=True, host="::2")
    answer = TestClient(six).get("/api/state", params={"token": TOKEN}, headers={"host": "[::2]:1"})
    assert answer.status_code == 200


def test_the_token_is_in_the_printed_address_only_never_in_the_logs(capfd, caplog):
    """A real server (uvicorn): the printed address's token sets the cookie, the cookie
    alone gets the scripts, nothing without it; no log line holds the token (nor a wrong
    one). A token with characters an address cannot carry is quoted in it."""
    import logging
    import urllib.error
    import urllib.parse

    caplog.set_level(logging.DEBUG)
    state = PageState()
    state.add_round(record(1))
    with LivePage(state, token=TOKEN) as page:
        base = f"http://127.0.0.1:{page.port}/"
        with urllib.request.urlopen(page.url, timeout=10) as answer:
            said = answer.headers["set-cookie"]
        cookie = said.split(";", 1)[0]
        assert cookie.startswith(f"fedlb-page-{page.port}=")
        asked = urllib.request.Request(base + "static/page.js", headers={"cookie": cookie})
        with urllib.request.urlopen(asked, timeout=10) as answer:
            assert answer.status == 200
        for url in (base + "static/page.js", base + "api/state?token=wrong-token-abc"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(url, timeout=10)
            assert refused.value.code == 401
    logged = capfd.readouterr()
    for text in (logged.out, logged.err, caplog.text):
        assert TOKEN not in text
        assert "wrong-token-abc" not in text
    odd = "a token & #with spaces/+"
    url = LivePage(PageState(), token=odd).url
    assert urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)["token"] == [odd]


def test_another_address_than_loopback_needs_a_token():
    assert is_loopback("127.0.0.1")
    assert is_loopback("localhost")
    assert is_loopback("::1")
    assert not is_loopback("0.0.0.0")
    check_binding("127.0.0.1", None)
    with pytest.raises(PageError, match="--page-token"):
        check_binding("0.0.0.0", None)
    with pytest.raises(PageError, match="at least 12"):
        check_binding("0.0.0.0", "short")
    check_binding("0.0.0.0", TOKEN)
    with pytest.raises(PageError):
        LivePage(PageState(), "0.0.0.0")


def test_the_page_serves_on_a_thread_and_stops():
    state = PageState()
    state.add_round(record(1))
    with LivePage(state) as page:
        assert page.url == f"http://127.0.0.1:{page.port}/"
        with urllib.request.urlopen(page.url + "api/state", timeout=10) as answer:
            assert json.loads(answer.read())["rounds"][0]["round"] == 1
    with LivePage(state, token=TOKEN) as page:
        assert page.url.endswith(f"?token={TOKEN}")


def test_the_cli_refuses_an_exposed_page_without_a_token():
    from typer.testing import CliRunner

    from fedlb.cli import app

    said = CliRunner().invoke(app, ["demo", "--page-host", "0.0.0.0", "--num-rounds", "1"])
    assert said.exit_code == 2
    assert "--page-token" in " ".join(said.output.split())


def test_the_guards_verdict_joins_the_round_records_events():
    """The page shows the stability guard's verdicts: guard_round tells its `note` what it
    logs (an update left out as diverged)."""
    from fedlb.balance import StabilityGuard
    from fedlb.flower.protocol import SiloReport
    from fedlb.flower.stability import guard_round

    said = {  # node 3: 5.5x the others' median, at the smallest batch (not its own fault)
        node: SiloReport(size, 1, 0.1, 0.0, update_norm=norm)
        for node, size, norm in ((1, 16, 1.0), (2, 16, 1.2), (3, 8, 6.0))
    }
    notes: list[str] = []
    found, verdict = guard_round(
        StabilityGuard(), None, 0.0, 4, said, {}, [], lambda n: f"silo-{n}", notes.append
    )
    assert list(found) == [3]
    assert verdict.regime == "edge"  # a blow-up before the probe
    assert notes == [f"silo-3's update diverged and is left out of the average: {found[3]}"]


def test_a_poll_between_rounds_gets_only_the_version():
    state = PageState()
    state.add_round(record(1))
    client = TestClient(make_app(state))
    version = client.get("/api/state").json()["version"]
    answer = client.get("/api/state", params={"since": version}).json()
    assert answer["unchanged"] is True
    assert "rounds" not in answer
    state.add_round(record(2))
    assert len(client.get("/api/state", params={"since": version}).json()["rounds"]) == 2


def test_a_resumed_servers_page_starts_with_the_rounds_it_kept(tmp_path):
    from fedlb.cli.federation import page_rounds_before

    path = tmp_path / "rounds.jsonl"
    path.write_text("".join(line + "\n" for n in (1, 2) for line in record(n).json_lines()))
    state = PageState()
    state.start_run("fedlb server", num_rounds=5)
    page_rounds_before(state, path)
    page_rounds_before(state, tmp_path / "none.jsonl")  # a fresh run: nothing, no error
    shot = state.snapshot()
    assert [r["round"] for r in shot["rounds"]] == [1, 2]
    assert shot["silos"][0]["last_round"] == 2
    assert shot["silos"][0]["last_seen"] is None  # not seen by this process


def test_a_loopback_page_answers_loopbacks_host_names_with_their_ports():
    client = TestClient(make_app(PageState()))
    for host in ("127.0.0.1:8050", "localhost:8050", "[::1]:8050", "LOCALHOST"):
        assert client.get("/api/state", headers={"host": host}).status_code == 200, host
    for host in (
        "evil.example:8050",
        "127.0.0.1.evil.example",
        "[::2]:8050",
        "127.0.0.1:8050@evil.example",  # issue 56: was read as 127.0.0.1
        "127.0.0.1:80:80",
        "[::1]evil",
        "",
    ):
        assert client.get("/api/state", headers={"host": host}).status_code == 400, host


def test_a_token_with_a_nul_or_more_appended_is_not_the_token():
    """Issue 56: `?token=T%00` was let in (HMAC pads its key with zero bytes)."""
    app = make_app(PageState(), token=TOKEN, loopback=False)
    for given in (TOKEN + "\0", TOKEN + "\0\0", TOKEN[:-1], "\0" + TOKEN):
        assert TestClient(app).get("/", params={"token": given}).status_code == 401, given
        bearer = {"authorization": f"Bearer {given}"}
        assert TestClient(app).get("/api/state", headers=bearer).status_code == 401
    raw = TestClient(app).get(f"/?token={TOKEN}%00")
    assert raw.status_code == 401
    assert TestClient(app).get("/", params={"token": TOKEN}).status_code == 200


def test_a_silos_text_reaches_the_page_with_its_control_characters_written_out():
    """Issue 56, item 2: a failure and an event holding ESC and OSC 8 sequences."""
    state = PageState()
    shown = record(1)
    shown.failed = ["silo-1: ValueError: \x1b[31mred\x1b]8;;http://evil.example\x07"]
    shown.events = ["silo-1: metric '\x9bname' dropped"]
    state.add_round(shown)
    text = json.dumps(TestClient(make_app(state)).get("/api/state").json())
    assert "\\x1b[31mred" in text
    assert "\\x9bname" in text
    assert "\\u001b" not in text  # no raw ESC, which JSON would carry as \u001b
    assert "\\u009b" not in text


def test_who_has_replied_within_the_round_comes_from_the_progress_file(tmp_path):
    """The ServerApp replaces round-progress.json as replies arrive; the page shows
    round 3's replies so far and who is still training, and its version moves with the
    file so that a page polling `?since=` redraws."""
    from fedlb.flower import RUN_FILES, RoundReporter

    state = PageState()
    state.start_run("fedlb server", out_dir=str(tmp_path), num_rounds=5)
    state.add_round(record(1))
    state.add_round(record(2))
    reporter = RoundReporter(tmp_path)
    reporter.progress(2, ["silo-0", "silo-1"], {"silo-0": 1.0, "silo-1": 1.2})  # stale
    assert state.snapshot()["current"]["in_flight"] is None
    before = state.version
    reporter.progress(3, ["silo-0", "silo-1"], {"silo-1": 0.8})
    assert state.version > before
    assert state.snapshot()["current"]["in_flight"] == {
        "sent": ["silo-0", "silo-1"],
        "replied": {"silo-1": 0.8},
        "waiting": ["silo-0"],
    }
    (tmp_path / RUN_FILES.progress).write_text("{half")  # being replaced: no error
    assert state.snapshot()["current"]["in_flight"] is None


@pytest.mark.slow
def test_fedlb_servers_page_settings_come_from_its_config_file(tmp_path):
    """`fedlb server --config`: the [server] table's page-port places the page, and
    page = false serves none (the run itself gives up after its --run-timeout: no silo)."""
    import subprocess
    import sys

    from fedlb.deploy.processes import free_port

    def serve(table: str, out: str) -> str:
        config = tmp_path / f"{out}.toml"
        config.write_text(f"[server]\n{table}\n")
        command = [sys.executable, "-m", "fedlb.cli", "server", "--config", str(config)]
        command += ["--port", "0", "--num-silos", "1", "--run-timeout", "3"]
        command += ["--out-dir", str(tmp_path / out)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        output = " ".join((done.stdout + done.stderr).split())
        assert done.returncode == 1, output  # no silo joined before its --run-timeout
        assert "SuperLink on 127.0.0.1:" in output
        return output

    port = free_port()
    assert f"live page: http://127.0.0.1:{port}/" in serve(f"page-port = {port}", "on")
    assert "live page" not in serve("page = false", "off")
