"""Benchmark of CKKS encryption of model updates (fedlb.he), all figures measured in one run.

1. Per model (MLP on digits, LeNet-5 and the small CNN on 28x28 images): a silo's encrypt
   and decrypt seconds, the server's aggregation of 5 silos' updates (load and check the
   ciphertexts, the weighted sum, serialise), ciphertexts per update, bytes per update
   against (ciphertexts needed x one ciphertext's size), expansion over float32.
2. Paillier (python-paillier with gmpy2, 2048-bit keys: BatchCrypt's baseline) on the same
   LeNet-5 update: measured on a sample of values and scaled to the update (each value is
   encrypted on its own, so the cost is linear in the count).
3. HE's share of the round in the paper-like LeNet-5 setting (5 silos, ec2-5 speeds x 200
   samples/s, 0.5 s fixed cost, tau = 20, B0 = 32; model clock plus the HE seconds
   measured here): the silos' HE seconds over the round time, lb policy.

    .venv/bin/python benchmarks/he.py [--quick] [--json results.json]

Prints Markdown tables; docs/benchmarks.md keeps the latest ones with this command.
Clock for costs: wall (time.perf_counter) on this machine.
"""

from __future__ import annotations

import functools
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tenseal
import torch
from flwr.app import ArrayRecord

from fedlb.experiments import markdown_table as table
from fedlb.experiments import run_benchmark
from fedlb.flower import EncryptedAggregation
from fedlb.flower.he import encrypted_record
from fedlb.he import context_info, decrypt_arrays, encrypt_arrays, generate_keys, public_context
from fedlb.models import build_model

MODELS = {"mlp": (64,), "lenet5": (1, 28, 28), "cnn": (1, 28, 28)}
SILOS = 5


def timed(function: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Median seconds over `repeats` calls, and the last result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def update_of(name: str, seed: int) -> dict[str, np.ndarray]:
    model = build_model(name, MODELS[name], 10, seed)
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


def record_bytes(record: ArrayRecord) -> int:
    """Bytes of the record's array payloads as Flower carries them."""
    return sum(len(array.data) for array in record.values())


# ---- 1. CKKS per model -----------------------------------------------------------------


def ckks_costs(quick: bool, figures: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    repeats = 1 if quick else 3
    secret = generate_keys()
    server = EncryptedAggregation(public_context(secret))
    full = tenseal.ckks_vector(
        secret, np.zeros(context_info(secret).poly_modulus_degree // 2)
    ).serialize()
    one_ciphertext = len(full)
    rows: list[list[str]] = []
    data: dict[str, Any] = {}
    for name in MODELS:
        updates = [update_of(name, seed) for seed in range(SILOS)]
        params = sum(a.size for a in updates[0].values())
        first = updates[0]
        encrypt_s, (ciphertexts, layout) = timed(
            functools.partial(encrypt_arrays, secret, first), repeats
        )
        decrypt_s, _ = timed(
            functools.partial(decrypt_arrays, secret, ciphertexts, layout), repeats
        )
        records = [encrypted_record(*encrypt_arrays(secret, u)) for u in updates]
        weights = [float(100 + 37 * k) for k in range(SILOS)]

        def aggregate(records: list[ArrayRecord] = records, weights: list[float] = weights) -> Any:
            loaded = [server.check(r, records[0]) for r in records]
            return server.average(loaded, weights, records[0])

        aggregate_s, _ = timed(aggregate, repeats)
        wire = record_bytes(records[0])
        needed = layout.count * one_ciphertext
        rows.append(
            [
                name,
                f"{params:,}",
                str(layout.count),
                f"{encrypt_s:.3f}",
                f"{decrypt_s:.3f}",
                f"{aggregate_s:.3f}",
                f"{wire / 1e6:.2f}",
                f"{wire / needed:.3f}",
                f"{wire / (4 * params):.1f}x",
            ]
        )
        data[name] = {
            "params": params,
            "ciphertexts": layout.count,
            "encrypt_s": encrypt_s,
            "decrypt_s": decrypt_s,
            "aggregate_5_s": aggregate_s,
            "bytes_per_update": wire,
            "bytes_over_needed": wire / needed,
            "expansion_over_float32": wire / (4 * params),
        }
    text = table(
        [
            "model",
            "parameters",
            "ciphertexts",
            "encrypt s",
            "decrypt s",
            f"aggregate {SILOS} silos s",
            "MB per update",
            "bytes / (ciphertexts x one)",
            "vs float32",
        ],
        rows,
    )
    text += (
        f"\n\nCKKS N = 8192 (4,096 slots), moduli 60-40-60 bits, scale 2^40; one full "
        f"ciphertext serialises to {one_ciphertext:,} bytes. Aggregate: load and check each "
        "ciphertext, weight by dataset size, sum, serialise (server, public context only). "
        f"Median of {repeats}."
    )
    data["one_ciphertext_bytes"] = one_ciphertext
    return text, {"ckks": data}


# ---- 2. Paillier on the same LeNet-5 update ---------------------------------------------


def paillier_costs(quick: bool, figures: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    try:
        import gmpy2  # noqa: F401  (python-paillier is ~10x slower without it)
        from phe import paillier
    except ImportError:
        return "python-paillier or gmpy2 missing: `pip install phe gmpy2`", {}
    sample = 50 if quick else 300
    public, private = paillier.generate_paillier_keypair(n_length=2048)
    values = np.concatenate([a.ravel() for a in update_of("lenet5", 0).values()])
    params = values.size
    chosen = [float(v) for v in values[:sample]]
    start = time.perf_counter()
    encrypted = [public.encrypt(v) for v in chosen]
    encrypt_per = (time.perf_counter() - start) / sample
    start = time.perf_counter()
    total = [e * 0.2 for e in encrypted]  # the weighted sum: a scalar product per silo,
    for _ in range(SILOS - 1):  # and a sum per silo after the first
        total = [t + e * 0.2 for t, e in zip(total, encrypted, strict=True)]
    aggregate_per = (time.perf_counter() - start) / sample
    start = time.perf_counter()
    for e in encrypted:
        private.decrypt(e)
    decrypt_per = (time.perf_counter() - start) / sample
    bytes_per = public.n.bit_length() * 2 // 8  # a ciphertext is an integer mod n^2
    lenet = figures["ckks"]["lenet5"]
    rows = [
        [
            "encrypt s",
            f"{lenet['encrypt_s']:.3f}",
            f"{encrypt_per * params:,.0f}",
            f"{encrypt_per * params / lenet['encrypt_s']:,.0f}x",
        ],
        [
            f"aggregate {SILOS} silos s",
            f"{lenet['aggregate_5_s']:.3f}",
            f"{aggregate_per * params:,.1f}",
            f"{aggregate_per * params / lenet['aggregate_5_s']:,.0f}x",
        ],
        [
            "decrypt s",
            f"{lenet['decrypt_s']:.3f}",
            f"{decrypt_per * params:,.0f}",
            f"{decrypt_per * params / lenet['decrypt_s']:,.0f}x",
        ],
        [
            "MB per update",
            f"{lenet['bytes_per_update'] / 1e6:.2f}",
            f"{bytes_per * params / 1e6:,.1f}",
            f"{bytes_per * params / lenet['bytes_per_update']:,.1f}x",
        ],
    ]
    text = table(["LeNet-5 update", "CKKS (packed)", "Paillier 2048-bit", "Paillier / CKKS"], rows)
    text += (
        f"\n\n{params:,} values. Paillier measured on {sample} of them (python-paillier "
        "with gmpy2) and scaled to the update: one ciphertext per value, so cost and size "
        "are linear in the count (BatchCrypt's batching would pack a few values per "
        "ciphertext; CKKS packs 4,096)."
    )
    return text, {
        "paillier": {
            "encrypt_s_per_value": encrypt_per,
            "aggregate_s_per_value": aggregate_per,
            "decrypt_s_per_value": decrypt_per,
            "bytes_per_value": bytes_per,
            "update_encrypt_s": encrypt_per * params,
            "update_bytes": bytes_per * params,
        }
    }


# ---- 3. HE's share of the round in the paper-like setting -------------------------------


def round_share(quick: bool, figures: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    from fedlb.experiments import Scenario, run_policy

    scenario = Scenario.from_mapping(
        {
            "name": "paper-lenet5-he",
            "dataset": "fashion-mnist",
            "silos": SILOS,
            "speeds": "ec2-5",
            "base-speed": 200.0,
            "overheads": "0.5",
            "partition": "classes:2",
            "model": "lenet5",
            "rounds": 3 if quick else 5,
            "local-steps": 20,
            "batch-size": 32,
            "learning-rate": 0.02,
            "clock": "model",
            "policies": "lb",
            "he": True,
        }
    )
    with tempfile.TemporaryDirectory() as folder:
        result = run_policy(scenario, "lb", Path(folder))
    shares, he_max, rounds = [], [], []
    for record in result.records:
        he = max(s.he_s for s in record.silos)
        shares.append(statistics.fmean(s.he_s / s.round_s for s in record.silos))
        he_max.append(he)
        assert record.round_s is not None  # run_policy refuses runs without round times
        rounds.append(record.round_s)
    rows = [
        [
            str(r.round),
            f"{rounds[i]:.2f}",
            f"{he_max[i]:.3f}",
            f"{he_max[i] / rounds[i]:.1%}",
            f"{shares[i]:.1%}",
        ]
        for i, r in enumerate(result.records)
    ]
    text = table(
        ["round", "round s", "largest silo HE s", "of the round", "mean silo HE share"], rows
    )
    mean_share = statistics.fmean(h / r for h, r in zip(he_max, rounds, strict=True))
    text += (
        f"\n\nClock: model (t_i = 0.5 s + tau B_i / v_i) plus each silo's HE seconds measured "
        f"on this machine. HE takes {mean_share:.1%} of the round on average (largest silo's "
        "HE time over the round time)."
    )
    return text, {"he_share": {"mean": mean_share, "per_round": shares}}


def main() -> None:
    run_benchmark(
        "fedlb.he benchmark",
        __doc__.splitlines()[0],
        f"{torch.get_num_threads()} torch threads, TenSEAL {tenseal.__version__}. Clock for "
        "costs: wall (time.perf_counter).",
        [
            ("CKKS per update", ckks_costs),
            ("Paillier on the same update", paillier_costs),
            ("HE share of the round (paper-like LeNet-5)", round_share),
        ],
    )


if __name__ == "__main__":
    main()
