"""A longer run's first N rounds, as the run of N rounds it equals.

Nothing in a quickstart run depends on the rounds planned (no schedule; the guard decides
in rounds 2-3; the seed fixes the rest), so a 16-round run's first 8 rounds are the 8-round
run of the same seed bit for bit: checked on the 180 runs that both files here hold
(equal-clock/quickstart-iid-1to8-lr0.1.jsonl against quickstart-iid-1to8-lr0.1.jsonl, every
accuracy of rounds 0-8 equal). So seeds run once at stock's clock give both tables' rows.
Each line's per-round lists are cut to N, its final accuracy is round N's; its wall
seconds are those of the whole run (not used by the tables), its final floor is dropped
where an update was left out after round N (the floor may have risen then).
Run from the repository root:
    .venv/bin/python docs/results/adaptive-default/first_rounds.py IN.jsonl N >> OUT.jsonl
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, ".")
from benchmarks.app_accuracy import DEAD

PER_ROUND = ("efficiency", "round_s", "sizes", "norms_per_step", "train_loss", "excluded")

source, rounds = sys.argv[1], int(sys.argv[2])
for line in Path(source).read_text().splitlines():
    row = json.loads(line)
    if row["rounds"] < rounds:
        raise SystemExit(f"{source}: seed {row['seed']} ran {row['rounds']} rounds, not {rounds}")
    later = row.get("excluded", [])[rounds:]
    row["accuracy_by_round"] = row["accuracy_by_round"][: rounds + 1]
    for key in PER_ROUND:
        if key in row:
            row[key] = row[key][:rounds]
    row["final_accuracy"] = row["accuracy_by_round"][-1]
    row["collapsed"] = row["final_accuracy"] <= DEAD
    row["first_rounds_of"] = row["rounds"]
    row["rounds"] = rounds
    if any(later):
        row.pop("floor", None)
    print(json.dumps(row))
