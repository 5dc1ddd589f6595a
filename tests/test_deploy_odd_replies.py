"""One odd silo does not end a deployed federation (issue 56, "Done when"), on real
processes: Flower's quickstart-pytorch made load-balanced (tests/apps/adopt.py) under
`fedlb server --app` and three `fedlb silo --app` on 127.0.0.1. Partition 1's ClientApp
is rewritten by a mod of its own: in round 2 it adds an extra metric key (Flower's
FedAvg raised InconsistentMessageReplies and the run failed there), in round 3 it raises
with terminal escapes in its message (ESC colour, an OSC 8 hyperlink, a CSI clear), in
round 4 it names a metric with them. The run completes its 5 rounds, exit 0; no escape
sequence from the silo reaches the server's console nor its ServerApp log, where each is
said in one line naming silo-1 with the escapes written out."""

from __future__ import annotations

import json

import pytest

from tests.apps.adopt import adopt
from tests.test_deploy_user_app import federation, said

pytestmark = pytest.mark.slow

ODD_MOD = '''

def _odd(msg, context, call_next):
    """Partition 1 (issue 56's probe): round 2 an extra metric key, round 3 an error whose
    message holds terminal escapes, round 4 a metric named with them."""
    if msg.metadata.message_type != "train" or context.node_config["partition-id"] != 1:
        return call_next(msg, context)
    server_round = msg.content["config"]["server-round"]
    if server_round == 3:
        raise ValueError(ESCAPES)
    reply = call_next(msg, context)
    if server_round == 2:
        reply.content["metrics"]["extra"] = 1.0
    if server_round == 4:
        reply.content["metrics"][ESCAPES] = 1.0
    return reply
'''
# ESC colour, an OSC 8 hyperlink (BEL-terminated), a C1 CSI that clears the screen
ESCAPES = "\\x1b[31mred\\x1b]8;;http://evil.example\\x07link\\x1b]8;;\\x07\\x9b2J"
RAW = ("\x1b", "\x9b", "\x07")


def odd_app(tmp_path):
    app, _ = adopt("quickstart_pytorch", tmp_path)
    client = next(app.glob("*/client_app.py"))
    client.write_text(
        client.read_text().replace(
            "app = ClientApp(mods=[balance_mod()])",
            f'ESCAPES = "{ESCAPES}"\n'
            + ODD_MOD.lstrip("\n")
            + "\napp = ClientApp(mods=[_odd, balance_mod()])",
        )
    )
    return app


@pytest.mark.timeout(1200)
def test_a_silo_with_odd_replies_and_terminal_escapes_does_not_end_the_run(tmp_path):
    code, raw, _, out = federation(odd_app(tmp_path), tmp_path, 5, timeout=1000)
    output = raw.decode(errors="replace")
    text = said(output)
    assert code == 0, output[-4000:]
    assert "completed: rounds 1-5" in text, text[-3000:]
    for sequence in RAW:  # none of the silo's escapes reaches the operator's console
        assert sequence.encode() not in raw, output[-3000:]
    rows = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    assert sorted({r["round"] for r in rows}) == [1, 2, 3, 4, 5]
    silos_by_round = {k: {r["silo"] for r in rows if r["round"] == k} for k in range(1, 6)}
    assert silos_by_round[2] == {"silo-0", "silo-1", "silo-2"}  # the extra key dropped only
    assert silos_by_round[3] == {"silo-0", "silo-2"}  # silo-1 raised
    assert silos_by_round[4] == {"silo-0", "silo-1", "silo-2"}

    def said_in(k: int, field: str) -> str:
        return " ".join(line for r in rows if r["round"] == k for line in r[field])

    assert "silo-1: metric 'extra' dropped from its reply" in said_in(2, "events")
    written_out = "\\x1b[31mred\\x1b]8;;http://evil.example\\x07link"
    assert f"silo-1: metric '{written_out}" in said_in(4, "events")
    assert written_out in said_in(3, "failed")
    assert "metric 'extra' dropped" in text  # the round table's events, on the console
    logs = list(out.rglob("serverapp-*.log"))
    assert logs, list(out.rglob("*"))
    logged = b"".join(p.read_bytes() for p in logs)
    # Flower colours its own level names (ESC [92m INFO): the silo's sequences are checked
    for sequence in ("\x1b[31m", "\x1b]8;;", "\x9b", "\x07"):
        assert sequence.encode() not in logged, sequence
    assert b"silo-1: metric 'extra' dropped from its reply" in logged
    assert b"Received error in reply from node" in logged  # FedAvg's own line, written out


CLAIMING_MOD = '''

def _claiming(msg, context, call_next):
    """Partition 1 claims 9.97x its own example count (issue 56: 83% of the model, unsaid)."""
    reply = call_next(msg, context)
    if msg.metadata.message_type == "train" and context.node_config["partition-id"] == 1:
        metrics = reply.content["metrics"]
        metrics["num-examples"] = int(metrics["num-examples"] * 9.97)
    return reply
'''


@pytest.mark.timeout(900)
def test_a_silo_that_outweighs_the_others_is_named_every_round(tmp_path):
    """Issue 56, item 3, on real processes: with no cap and no declared counts, the silo
    is named in every round's events (the round table on the console, rounds.jsonl, which
    the live page shows), with what the operator can do."""
    app, _ = adopt("quickstart_pytorch", tmp_path)
    client = next(app.glob("*/client_app.py"))
    client.write_text(
        client.read_text().replace(
            "app = ClientApp(mods=[balance_mod()])",
            CLAIMING_MOD.lstrip("\n") + "\napp = ClientApp(mods=[_claiming, balance_mod()])",
        )
    )
    code, raw, _, out = federation(app, tmp_path, 3)
    text = said(raw.decode(errors="replace"))
    assert code == 0, text[-3000:]
    rows = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines()]
    for k in (1, 2, 3):
        events = " ".join({e for r in rows if r["round"] == k for e in r["events"]})
        assert "silo-1 outweighs all other silos together: 83% of round" in events, events
        assert f"of round {k}'s average" in events
        assert "--max-share 0.5" in events
        assert "--silo-examples" in events
    assert text.count("outweighs all other silos together") >= 3  # the console's tables
