"""FLamby Fed-Heart-Disease's FedAvg, as its benchmark runs it, on fedlb's data preparation.

The reference fedlb's own runs of the benchmark are judged against (issue 14): FLamby's
protocol in plain torch (docs/flamby-heart-disease.md) — Linear(13, 1) + sigmoid, BCE,
per centre one shuffled batch stream of 4 carried across rounds (epochs end short), SGD
lr 1e-3, 100 local updates per round, 15 rounds, the updates averaged by training size —
fed by `fedlb.data.flamby_heart.load_flamby_heart`. Prints per seed the pooled-test and
per-centre accuracy beside FLamby's stored results (seeds 42-46).

    .venv/bin/python benchmarks/flamby_heart.py

Clock: none (accuracy only); about 10 s on 2 cores.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator

import numpy as np
import torch

from fedlb.data.flamby_heart import FlambyHeart, load_flamby_heart

SEEDS = (42, 43, 44, 45, 46)
# flamby/results/results_benchmark_fed_heart_disease/heart_seed4{2..6}.csv, Pooled Test
FLAMBY_POOLED = (0.752, 0.764, 0.764, 0.701, 0.760)
BATCH, LEARNING_RATE, LOCAL_UPDATES, ROUNDS = 4, 1e-3, 100, 15


def batches(
    x: torch.Tensor, y: torch.Tensor, rng: torch.Generator
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One shuffled stream of batches of BATCH, the last of each epoch short, for ever."""
    while True:
        order = torch.randperm(len(y), generator=rng)
        for start in range(0, len(y), BATCH):
            chosen = order[start : start + BATCH]
            yield x[chosen], y[chosen]


def accuracy(model: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    with torch.no_grad():
        said = torch.sigmoid(model(torch.from_numpy(x))).squeeze(1) > 0.5
    return float((said.numpy() == y).mean())


def fedavg(heart: FlambyHeart, seed: int) -> tuple[float, float]:
    """(pooled-test accuracy, mean per-centre accuracy) after ROUNDS rounds."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(13, 1)
    rng = torch.Generator().manual_seed(seed)
    streams = [
        batches(torch.from_numpy(p.x), torch.from_numpy(p.y.astype(np.float32)), rng)
        for p in heart.train
    ]
    weights = np.array(heart.train_sizes, dtype=float) / sum(heart.train_sizes)
    for _ in range(ROUNDS):
        states = []
        for stream in streams:
            local = torch.nn.Linear(13, 1)
            local.load_state_dict(model.state_dict())
            optimizer = torch.optim.SGD(local.parameters(), lr=LEARNING_RATE)
            for _ in range(LOCAL_UPDATES):
                x, y = next(stream)
                loss = torch.nn.functional.binary_cross_entropy(
                    torch.sigmoid(local(x)).squeeze(1), y
                )
                optimizer.zero_grad()
                loss.backward()  # type: ignore[no-untyped-call]
                optimizer.step()
            states.append(local.state_dict())
        model.load_state_dict(
            {
                k: sum(float(w) * s[k] for w, s in zip(weights, states, strict=True))
                for k in states[0]
            }
        )
    per_centre = [accuracy(model, t.x, t.y) for t in heart.test]
    return accuracy(model, heart.pooled_test.x, heart.pooled_test.y), statistics.mean(per_centre)


def main() -> None:
    heart = load_flamby_heart()
    results = [fedavg(heart, seed) for seed in SEEDS]
    print("seed  pooled test (FLamby)  per-centre mean")
    for seed, (pooled, per_centre), theirs in zip(SEEDS, results, FLAMBY_POOLED, strict=True):
        print(f"{seed}   {pooled:.3f} ({theirs:.3f})        {per_centre:.3f}")
    pooled_all = [r[0] for r in results]
    print(
        f"pooled {statistics.mean(pooled_all):.3f} ± {statistics.stdev(pooled_all):.3f} "
        f"(FLamby 0.748 ± 0.024); per-centre mean {statistics.mean(r[1] for r in results):.3f} "
        "(FLamby 0.685)"
    )


if __name__ == "__main__":
    main()
