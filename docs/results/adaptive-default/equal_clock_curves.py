"""The measured GPU-beside-CPU curves' second runs at equal clock: the default's (50 rounds)
against the floor's (30 rounds), each seed's central accuracy when the floor's 30 rounds
end on the model clock. Reads the two experiments' rounds.jsonl (seeds 6-17):
    experiment-h200-beside-cpus-second-run-seeds6-17/  (lb and lb-floor, 30 rounds)
    equal-clock/experiment-h200-beside-cpus-second-run-lb-50-rounds/  (lb, 50 rounds)
A 50-round run's first 30 rounds are its 30-round run's (checked on every seed).
Run from the repository root:
    .venv/bin/python docs/results/adaptive-default/equal_clock_curves.py
"""

import json
import statistics
from pathlib import Path

HERE = Path(__file__).parent


def curves(path: Path, policy: str) -> dict[int, list[tuple[float, float]]]:
    """seed -> [(clock at the round's end, central accuracy)]"""
    rounds: dict[int, dict[int, dict]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row["policy"] == policy:
            rounds.setdefault(row["seed"], {}).setdefault(row["round"], row)
    out = {}
    for seed, by_round in rounds.items():
        clock, points = 0.0, []
        for k in sorted(by_round):
            clock += by_round[k]["round_s"]
            points.append((clock, by_round[k]["server_accuracy"]))
        out[seed] = points
    return out


def at(points: list[tuple[float, float]], clock: float) -> float:
    return [a for t, a in points if t <= clock + 1e-9][-1]


thirty = HERE / "experiment-h200-beside-cpus-second-run-seeds6-17" / "rounds.jsonl"
fifty = HERE / "equal-clock" / "experiment-h200-beside-cpus-second-run-lb-50-rounds" / "rounds.jsonl"
floor, default30, default = curves(thirty, "lb-floor"), curves(thirty, "lb"), curves(fifty, "lb")
rows = []
for seed in sorted(default):
    assert default[seed][29][1] == default30[seed][-1][1], seed  # its first 30 rounds
    end = floor[seed][-1][0]
    rows.append((seed, end, at(default[seed], end), floor[seed][-1][1], default30[seed][-1][1]))
    print(
        f"seed {seed}: at the floor's 30-round clock ({end:.2f} s) default {rows[-1][2]:.3f} "
        f"(round {sum(t <= end + 1e-9 for t, _ in default[seed])}), floor {rows[-1][3]:.3f}; "
        f"after 30 rounds each: default {rows[-1][4]:.3f}"
    )
mean = statistics.fmean
diff = [r[2] - r[3] for r in rows]
print(
    f"{len(rows)} seeds, at equal clock: default {mean(r[2] for r in rows):.3f} ± "
    f"{statistics.stdev(r[2] for r in rows):.3f}, floor {mean(r[3] for r in rows):.3f} ± "
    f"{statistics.stdev(r[3] for r in rows):.3f}; the default higher on "
    f"{sum(d > 0 for d in diff)} (mean {mean(diff):+.3f}); after 30 rounds each: default "
    f"{mean(r[4] for r in rows):.3f}, higher on {sum(r[4] > r[3] for r in rows)}"
)
