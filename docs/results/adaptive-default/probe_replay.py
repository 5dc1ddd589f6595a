"""Replay the stability guard's probe on the recorded quickstart runs (the *.jsonl here and in
equal-clock/): each default run's update norms per step and sizes, rounds 1-3, fed to
fedlb's own StabilityGuard as measured (quiet=0, the default before 2026-11-27) and as the
default now reads them (a quiet probe net of batch noise). Rounds 1-3 run at the floor
until a verdict, so the recorded rounds decide either reading. The quickstart's replay gives
its recorded verdicts exactly; advanced-pytorch's (2 of 4 silos a round) and the `flwr new`
app's do not (one run each), so those two were rerun instead (bit for bit as recorded).
Run from the repository root:
    .venv/bin/python docs/results/adaptive-default/probe_replay.py
"""

import glob
import json
from pathlib import Path

from fedlb.balance import StabilityGuard

HERE = Path(__file__).parent


def verdict(row, **settings):
    guard = StabilityGuard(**settings)
    for norms, sizes in list(zip(row["norms_per_step"], row["sizes"], strict=False))[:3]:
        guard.check(norms, None, sizes)
    return guard.regime


for path in sorted(glob.glob(str(HERE / "*.jsonl"))) + sorted(glob.glob(str(HERE / "equal-clock/*.jsonl"))):
    rows = [json.loads(line) for line in open(path)]
    rows = [r for r in rows if r.get("policy") == "default" and r.get("norms_per_step")]
    if not rows:
        continue
    before = [verdict(r, quiet=0.0) for r in rows]
    now = [verdict(r) for r in rows]
    recorded = [r.get("regime") for r in rows]
    changed = [r["seed"] for r, a, b in zip(rows, before, now, strict=True) if a != b]
    print(
        f"{Path(path).relative_to(HERE)!s:50} runs {len(rows):3d}  stable: recorded "
        f"{recorded.count('stable'):2d}, replayed as measured {before.count('stable'):2d}, "
        f"net of noise {now.count('stable'):2d}; changed seeds {changed}"
    )
