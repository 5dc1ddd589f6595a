"""What the live page shows, kept in the process that runs the federation: the run as it
was announced, every round record as rounds.jsonl has it, and the silos, the current round
and the events derived from them. Only what that process already holds: no message goes to
a silo for it, and nothing secret (no keys, no weights, no token) is ever put in it.

The state is written by the run's thread (a round's callback) and read by the page's
server thread, so every access holds one lock; a read is a JSON-ready copy. Within a round,
who has replied so far comes from the ServerApp's `round-progress.json` in the run's
out-dir (fedlb.flower's RoundReporter.progress), read when the page asks."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fedlb._markup import visible
from fedlb.flower import RUN_FILES, RoundRecord, accuracy_of
from fedlb.flower.identity import node_label
from fedlb.security import read_json

PROGRESS_BYTES = 2**20  # one round's silos and their reply times


def _clean(value: Any) -> Any:
    """NaN and infinities (a silo that did not report) become null: JSON has neither.
    Text (a silo's failure, an event naming its metric) with its control characters
    written out, as on the console (fedlb._markup.visible)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, str):
        return visible(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def record_json(record: RoundRecord) -> dict[str, Any]:
    """A round record as the page receives it: its fields as rounds.jsonl writes them
    (NaN as null), silos nested."""
    return dict(_clean(asdict(record)))


class PageState:
    """The live page's data. `start_run` begins a run (a server's, or one of a demo's
    side-by-side runs), `add_round` adds each finished round, `finish` says how it ended;
    an experiment's policies go through `start_policy` and `add_round(policy=...)`."""

    def __init__(self, title: str = "fedlb") -> None:
        self._lock = threading.Lock()
        self._version = 0  # grows with every change: a page that has it need not redraw
        self._title = title
        self._run: dict[str, Any] = {}
        self._rounds: list[dict[str, Any]] = []
        self._seen: dict[str, dict[str, Any]] = {}  # label -> last round/time replied
        self._policies: dict[str, list[list[float | None]]] = {}  # name -> [clock, acc]
        self._policy: str | None = None
        self._clock_s = 0.0  # the running policy's clock
        self._progress_stamp: int | None = None  # the progress file's mtime, last seen

    def start_run(
        self,
        name: str,
        *,
        address: str = "",
        out_dir: str = "",
        num_rounds: int | None = None,
        num_silos: int | None = None,
        local_silos: Sequence[tuple[str, str]] = (),
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        """A run begins: what the page says of it (a run's settings, without keys)."""
        with self._lock:
            self._run = {
                "name": name,
                "address": address,
                "out_dir": out_dir,
                "num_rounds": num_rounds,
                "num_silos": num_silos,
                "local_silos": {silo: words for silo, words in local_silos},
                "settings": dict(settings or {}),
                "started": time.time(),
                "status": "running",
            }
            self._rounds = []
            self._seen = {}
            self._version += 1

    def start_policy(self, name: str) -> None:
        """An experiment's next policy starts: its rounds join its own accuracy curve."""
        with self._lock:
            self._policy = name
            self._clock_s = 0.0
            self._policies[name] = []
            self._rounds = []
            self._seen = {}
            experiment = self._run.get("experiment") or self._run.get("name", "")
            self._run = {
                **self._run,
                "experiment": experiment,
                "name": f"{experiment}: {name}" if experiment else name,
                "status": "running",
            }
            self._version += 1

    def add_round(self, record: RoundRecord, live: bool = True) -> None:
        """A round finished (called as rounds.jsonl gets it); `live` False: one finished
        before this process started (a resumed run's), with no time it was seen."""
        now = time.time() if live else None
        row = record_json(record)
        row["seen"] = now  # when this process read it: the silos' "last seen"
        with self._lock:
            self._rounds = [r for r in self._rounds if r["round"] < record.round]
            self._rounds.append(row)
            for silo in record.silos:
                self._seen[silo.silo] = {"node": silo.node, "round": record.round, "time": now}
            if self._policy is not None:
                self._clock_s += record.round_s or 0.0
                self._policies[self._policy].append([self._clock_s, accuracy_of(record)])
            self._version += 1

    def finish(self, status: str) -> None:
        """The run ended: "completed", or why not."""
        with self._lock:
            self._run = {**self._run, "status": status}
            self._version += 1

    @property
    def version(self) -> int:
        """Grows with every change, a reply arriving within a round included."""
        with self._lock:
            stamp = self._progress_file_stamp()
            if stamp != self._progress_stamp:
                self._progress_stamp = stamp
                self._version += 1
            return self._version

    def _progress_path(self) -> Path | None:
        out_dir = self._run.get("out_dir")
        return Path(out_dir) / RUN_FILES.progress if out_dir else None

    def _progress_file_stamp(self) -> int | None:
        path = self._progress_path()
        try:
            return None if path is None else path.stat().st_mtime_ns
        except OSError:
            return None

    def _in_flight(self, number: int) -> dict[str, Any] | None:
        """Round `number`'s progress file: sent to, replied so far (seconds after the
        push), still waiting for; None where it holds another round or none."""
        path = self._progress_path()
        try:
            progress = read_json(path, max_bytes=PROGRESS_BYTES) if path is not None else None
        except (OSError, ValueError):  # StoredFileError too: a damaged one shows nothing
            return None  # not written yet, or being replaced: the next read has it
        if not isinstance(progress, dict) or progress.get("round") != number:
            return None
        sent, replied = progress.get("sent"), progress.get("replied")
        if not isinstance(sent, list) or not isinstance(replied, dict):
            return None  # not as the ServerApp writes it
        sent = [str(s) for s in sent]
        replied = {
            str(k): v
            for k, v in replied.items()
            if isinstance(v, int | float) and not isinstance(v, bool)  # seconds
        }
        return {
            "sent": sent,
            "replied": replied,
            "waiting": [s for s in sent if s not in replied],
        }

    def snapshot(self) -> dict[str, Any]:
        """Everything the page shows, as plain JSON-ready data."""
        with self._lock:
            rounds = [dict(r) for r in self._rounds]
            return dict(
                _clean(
                    {
                        "version": self._version,
                        "title": self._title,
                        "now": time.time(),
                        "run": dict(self._run),
                        "rounds": rounds,
                        "silos": self._silos(rounds),
                        "current": self._current(rounds),
                        "events": _events(rounds),
                        "policies": {k: list(v) for k, v in self._policies.items()},
                    }
                )
            )

    def _silos(self, rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One row per silo ever seen: its node, what it runs on, when it last replied and
        how many of the rounds since it first replied it missed."""
        local: Mapping[str, str] = self._run.get("local_silos", {})
        first: dict[str, int] = {}
        replied: dict[str, set[int]] = {}
        device: dict[str, str] = {}
        batch: dict[str, int] = {}
        for row in rounds:
            for silo in row["silos"]:
                label = silo["silo"]
                first.setdefault(label, row["round"])
                replied.setdefault(label, set()).add(row["round"])
                device[label] = _device(silo, local.get(label))
                batch[label] = silo["next_batch_size"]
        for label in local:
            first.setdefault(label, 1)
            device.setdefault(label, local[label])
        done = [row["round"] for row in rounds]
        rows = []
        for label in sorted(first):
            seen = self._seen.get(label, {})
            missed = [n for n in done if n >= first[label] and n not in replied.get(label, ())]
            rows.append(
                {
                    "silo": label,
                    # text: a Flower node id (64 bits) is more than a JS number holds
                    "node": node_label(seen["node"]) if "node" in seen else None,
                    "device": device.get(label, ""),
                    "last_round": seen.get("round"),
                    "last_seen": seen.get("time"),
                    "missed": len(missed),
                    "missed_rounds": missed,
                    "next_batch_size": batch.get(label),
                }
            )
        return rows

    def _current(self, rounds: list[dict[str, Any]]) -> dict[str, Any]:
        """The round under way (who has replied so far, who is still training) and who
        replied in the last one that finished."""
        last = rounds[-1] if rounds else None
        planned = self._run.get("num_rounds")
        running = self._run.get("status") == "running"
        number = (last["round"] + 1) if last else 1
        if planned is not None and number > planned:
            running = False
        return {
            "round": number if running else (last["round"] if last else None),
            "running": running,
            "in_flight": self._in_flight(number) if running else None,
            "last_round": last["round"] if last else None,
            "replied": [s["silo"] for s in last["silos"]] if last else [],
            "failed": [f.split(": ", 1)[0] for f in last["failed"]] if last else [],
        }


def _device(silo: Mapping[str, Any], local: str | None) -> str:
    """What a silo trains on, as far as the server knows: a local silo's emulation as the
    demo described it, a curve or an emulated speed it reported, else its own hardware."""
    if local:
        return local
    if silo.get("emulated_curve"):
        return f"emulates {silo['emulated_curve']}"
    if silo.get("emulated_speed"):
        return f"emulates {silo['emulated_speed']:.0f} samples/s"
    return "its own hardware"


def _events(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every round's events, newest first: membership (left, rejoined, left out, stale
    profiles, the guard's verdicts), reports dropped and silos with no update."""
    found = []
    for row in rounds:
        for kind, key in (("event", "events"), ("dropped", "rejected"), ("no update", "failed")):
            for text in row.get(key) or []:
                found.append({"round": row["round"], "kind": kind, "text": text})
    return found[::-1]
