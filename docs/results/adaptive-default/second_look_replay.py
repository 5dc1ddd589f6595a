"""Replay the stability guard with and without its second look (a probe scattered though the
silos' steps did not grow is looked at again in the next round, which decides) on every
recorded default run: the quickstart's and the other apps' JSON lines here (each run's
update norms per step and sizes, round by round) and the real GPU federations' rounds
(docs/results/gpu/*). Exact up to the verdict: a run the probe put at the edge ran the floor
from then on, and the second look's round runs at the floor too, so its recorded round is
what the second look would have seen. advanced-pytorch samples 2 of its 4 silos a round,
so its replay is not exact: its runs were rerun instead.
Run from the repository root:
    .venv/bin/python docs/results/adaptive-default/second_look_replay.py
"""

import glob
import json
from collections import Counter
from pathlib import Path

from fedlb.balance import StabilityGuard

HERE = Path(__file__).parent


def regime(rounds, **settings):
    guard = StabilityGuard(**settings)
    for norms, sizes in rounds:
        guard.check(norms, None, sizes)
        if guard.regime != "undecided":
            break
    return guard.regime


counts = Counter()
for path in sorted(glob.glob(str(HERE / "**/*.jsonl"), recursive=True)):
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        if row.get("policy") != "default" or not row.get("norms_per_step"):
            continue
        if row.get("second_run"):  # a second run takes its verdict up: no probe
            continue
        rounds = list(zip(row["norms_per_step"], row["sizes"], strict=False))
        before, now = regime(rounds, second_look=False), regime(rounds)
        counts[(before, now)] += 1
        if before != now:
            print(f"{Path(path).relative_to(HERE)} seed {row['seed']}: {before} -> {now}")
print("quickstart and apps, (without, with the second look):", dict(counts))

for path in sorted(glob.glob("docs/results/gpu/**/*default*rounds.jsonl", recursive=True)):
    by_round: dict[int, tuple[dict, dict]] = {}
    for line in Path(path).read_text().splitlines():
        row = json.loads(line)
        if row.get("update_norm") is None or not row.get("local_steps"):
            continue
        norms, sizes = by_round.setdefault(row["round"], ({}, {}))
        norms[row["silo"]] = row["update_norm"] / row["local_steps"]
        sizes[row["silo"]] = row["batch_size"]
    rounds = [by_round[k] for k in sorted(by_round)]
    print(f"{path}: {regime(rounds, second_look=False)} -> {regime(rounds)}")
