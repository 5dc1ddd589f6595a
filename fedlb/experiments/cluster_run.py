"""Cluster-mode experiments: one data-parallel job of N ranks on this machine (torchrun,
gloo), each rank emulating a machine of its own speed, balanced by a chosen policy.

`launch(scenario)` starts `torchrun --standalone --nproc-per-node N` on this module; every
rank runs `worker(scenario)` on its device (`device`: auto = cuda:LOCAL_RANK where there
are GPUs) with gradients on `backend` (auto = NCCL when every rank has a GPU of its own,
gloo otherwise); the coordinator's exchange is on gloo either way. Rank 0 writes
iterations.jsonl (one line per iteration and rank) and summary.json into the scenario's
`out` folder, and shows a table as it goes.
Every output names its clock: `measured` (real compute, sleep-padded to each rank's
profile: its speed, or its measured step-time curve, which the clock then names).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import vector_to_parameters
from torch.utils.data import DataLoader, TensorDataset

from fedlb.cluster import (
    ClusterError,
    DataPartitionManager,
    Shard,
    Snapshot,
    parse_policy,
)
from fedlb.data import LabelledData, federation_pool, partition
from fedlb.models import build_model
from fedlb.training import (
    Pace,
    ResizableBatchSampler,
    evaluate,
    tensor_dataset,
)

from .clocks import GpuLikeTime
from .cluster_jobs import (
    JobOutcome,
    bsp_job,
    eager_job,
    job_store,
    local_job,
    orchestra_job,
    ps_job,
)
from .cluster_scenario import ClusterScenario
from .load import CompetingLoad

log = logging.getLogger("fedlb.cluster")


def _pace(scenario: ClusterScenario, worker: int, machine: Callable[[], float]) -> Pace:
    """Worker `worker`'s emulated time for a batch: its profile's speed (or step-time
    curve) at its current iteration (each call is one iteration), times the machine's
    state (`machine()`: the competing load's slowdown, 1 without one)."""
    profile = scenario.profiles()[worker]
    iteration = [0]

    def pace(real_s: float, batch: int) -> float:
        iteration[0] += 1
        curve = profile.curve_at(iteration[0])
        if curve is not None:  # a measured curve: its seconds, slower under a load
            return max(real_s, curve.seconds(batch) / machine())
        speed = profile.speed_at(iteration[0]) * machine()
        if scenario.gpu_like:
            gpu = GpuLikeTime(speed, launch=scenario.launch, saturation=scenario.saturation)
            return max(real_s, gpu.compute_s(batch))
        return max(real_s, batch / speed)

    return pace


def _batches(
    dataset: TensorDataset, batch_size: int, seed: int, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless batches drawn from the whole dataset, seeded per worker."""
    sampler = ResizableBatchSampler(dataset, batch_size, seed=seed)
    for x, y in DataLoader(dataset, batch_sampler=sampler):
        yield x.to(device), y.to(device)


def evaluate_snapshots(
    model: nn.Module, snapshots: list[Snapshot], test: TensorDataset
) -> list[dict[str, float]]:
    """Each snapshot's test accuracy and loss (after the job: the timed run paid none)."""
    curve = []
    for snap in snapshots:
        vector_to_parameters(snap.weights, model.parameters())
        loss, accuracy = evaluate(model, test)
        curve.append(
            {
                "seconds": snap.seconds,
                "updates": snap.updates,
                "samples": snap.samples,
                "accuracy": accuracy,
                "loss": loss,
            }
        )
    return curve


def to_target(curve: list[dict[str, float]], target: float) -> dict[str, float] | None:
    """The first point of the curve at or above `target` accuracy (None: never)."""
    return next((point for point in curve if point["accuracy"] >= target), None)


def _shard_manager(
    scenario: ClusterScenario, rank: int, dataset: TensorDataset
) -> Callable[[], DataPartitionManager]:
    """This rank's own shard of the data (`shards`: iid or classes:K), behind a partition
    manager; without `partition-manager` it never moves a sample (only counts)."""

    def make() -> DataPartitionManager:
        x, y = dataset.tensors
        parts = partition(y.numpy(), scenario.nproc, scenario.shards, scenario.seed)
        index = torch.as_tensor(parts[rank], dtype=torch.long)
        threshold = scenario.partition_threshold if scenario.partition_manager else math.inf
        return DataPartitionManager(
            Shard(x[index], y[index], index),
            scenario.initial_sizes()[rank],
            threshold=threshold,
            check_every=scenario.partition_check,
            seed=scenario.seed,
        )

    return make


def worker(scenario: ClusterScenario) -> None:
    """One rank of the job (torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    torch.set_num_threads(1)  # N ranks share this machine's cores
    rank = int(os.environ["RANK"])
    device, backend = scenario.placement(int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    out = Path(scenario.out)
    (out / f"rank-{rank}.pid").write_text(str(os.getpid()))
    train, test = federation_pool(scenario.dataset, scenario.data_dir, 0, 0.2, scenario.seed)
    dataset = tensor_dataset(train.x, train.y)
    network = build_model(
        scenario.model, tuple(train.x.shape[1:]), train.num_classes, scenario.seed
    )
    name, policy, parameter = parse_policy(scenario.policy)
    # the parameter server is rank 0 of a ps job; its workers are ranks 1..nproc
    worker_index = rank - 1 if policy.engine == "ps" else rank
    load = None
    if scenario.load > 0 and worker_index >= 0:
        load = CompetingLoad(scenario.load, seed=scenario.seed * 100 + worker_index)
        load.start()
    slowdown = [1.0]  # bsp: the load's state as the iteration began (its loop sets it)

    def machine() -> float:
        if policy.engine == "bsp":
            return slowdown[0]
        return load.slowdown() if load is not None else 1.0

    pace = _pace(scenario, worker_index, machine) if worker_index >= 0 else None
    batches = _batches(dataset, scenario.batch_size, scenario.seed * 1009 + rank, device)
    try:
        if policy.engine == "bsp":
            data = _shard_manager(scenario, rank, dataset) if scenario.shards else dataset
            outcome = bsp_job(
                scenario, rank, network.to(device), data, device, backend, pace, load, slowdown
            )
        elif policy.engine == "ps":
            kind = name
            updates = scenario.iterations * (scenario.nproc if kind != "backup" else 1)
            outcome = ps_job(
                scenario.policy,
                kind,
                parameter,
                rank,
                scenario.nproc + 1,
                network,
                batches,
                scenario.learning_rate,
                updates,
                scenario.snapshot_s,
                pace,
                scenario.batch_size,
            )
        else:  # local SGD, Orchestra, eager-SGD: collectives on the job's process group
            dist.init_process_group(backend)
            model = network.to(device)
            lr, snapshot_s, batch = scenario.learning_rate, scenario.snapshot_s, scenario.batch_size
            if policy.engine == "orchestra":
                assert parameter is not None
                probe = dataset.tensors[0][:256].to(device), dataset.tensors[1][:256].to(device)
                shards = _shard_manager(scenario, rank, dataset)() if scenario.shards else None
                outcome = orchestra_job(
                    scenario.policy, parameter, rank, model, batches, probe, lr,
                    scenario.iterations, snapshot_s, pace, batch, scenario.seed, shards,
                    baseline="best" if name == "orchestra-paper" else "moving",
                )  # fmt: skip
            elif policy.engine == "local":
                assert parameter is not None
                outcome = local_job(
                    scenario.policy, parameter, rank, model, batches, lr,
                    scenario.iterations, snapshot_s, pace, batch,
                )  # fmt: skip
            else:
                mode = name.removeprefix("eager-")
                outcome = eager_job(
                    scenario.policy, mode, rank, model, batches, lr, scenario.iterations,
                    snapshot_s, pace, batch, job_store(), scenario.seed,
                )  # fmt: skip
            dist.barrier()
            dist.destroy_process_group()
    except (ClusterError, RuntimeError) as error:  # RPC's failures are RuntimeErrors
        reason = str(error) if isinstance(error, ClusterError) else f"rank {rank}: {error}"
        print(f"fedlb cluster: {reason}", file=sys.stderr, flush=True)
        raise SystemExit(1) from error
    finally:
        if load is not None:
            load.stop()
    clock = scenario.clock_label()  # the jobs' rows say "emulated speeds": curves named
    with (out / f"iterations-rank-{rank}.jsonl").open("w") as handle:
        for row in outcome.rows:
            line = {**row, "clock": clock, "device": device.type, "backend": backend}
            handle.write(json.dumps(line) + "\n")
    if rank == 0:
        _summarise(scenario, outcome, network.to("cpu"), test, device, backend)


def _summarise(
    scenario: ClusterScenario,
    outcome: JobOutcome,
    network: nn.Module,
    test: LabelledData,
    device: torch.device,
    backend: str,
) -> None:
    """summary.json: the job's hardware side (time per update) and statistical side
    (accuracy over time and updates, from the snapshots)."""
    held_out = tensor_dataset(test.x[: scenario.eval_samples], test.y[: scenario.eval_samples])
    curve = evaluate_snapshots(network, outcome.snapshots, held_out)
    target = to_target(curve, scenario.target_accuracy) if scenario.target_accuracy else None
    summary = {
        "scenario": dataclasses.asdict(scenario),
        "clock": scenario.clock_label(),
        "device": str(device),
        "backend": backend,
        "wall_s": outcome.wall_s,
        "updates": outcome.updates,
        "mean_update_s": outcome.wall_s / outcome.updates if outcome.updates else None,
        "ceiling": scenario.ceiling(),
        "final_accuracy": curve[-1]["accuracy"] if curve else None,
        "target_accuracy": scenario.target_accuracy or None,
        "time_to_target_s": None if target is None else target["seconds"],
        "updates_to_target": None if target is None else target["updates"],
        "samples_to_target": None if target is None else target["samples"],
        "accuracy": curve,
        "first_losses": outcome.losses[:10],
        "last_losses": outcome.losses[-10:],
        **outcome.extra,
    }
    (Path(scenario.out) / "summary.json").write_text(json.dumps(summary, indent=2))


def launch(scenario: ClusterScenario, out: Path, timeout: float | None = None) -> int:
    """Run the job with torchrun on this machine; returns its exit code (0: success)."""
    out.mkdir(parents=True, exist_ok=True)
    scenario = dataclasses.replace(scenario, out=str(out.resolve()))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only: this is one machine
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={scenario.processes}",
        "--module",
        "fedlb.experiments.cluster_run",
        json.dumps(scenario.to_mapping()),
    ]
    with (out / "torchrun.log").open("w") as log_file:
        process = subprocess.Popen(
            command, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        (out / "torchrun.pid").write_text(str(process.pid))
        replaced = None
        if threading.current_thread() is threading.main_thread():
            # stopped by SIGTERM (a scheduler, `timeout`): the job goes too, not left running
            replaced = signal.signal(signal.SIGTERM, _interrupt)
        try:
            code = process.wait(timeout=timeout)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            _stop(process, out)
            raise
        finally:
            if replaced is not None:
                signal.signal(signal.SIGTERM, replaced)
    parts = sorted(out.glob("iterations-rank-*.jsonl"), key=lambda p: int(p.stem.split("-")[-1]))
    with (out / "iterations.jsonl").open("w") as merged:
        for part in parts:
            merged.write(part.read_text())
            part.unlink()
    return code


def _stop(process: subprocess.Popen[bytes], out: Path) -> None:
    """Stop a job: torchrun first (it stops its ranks, which run in sessions of their
    own), then whatever is left, by the PIDs the ranks wrote (only processes that are
    still this module's ranks)."""
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    for pid_file in out.glob("rank-*.pid"):
        pid = int(pid_file.read_text())
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue  # gone
        if b"fedlb.experiments.cluster_run" in command:
            os.kill(pid, signal.SIGKILL)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _exit_now(code: int) -> None:
    """Leave without the interpreter's teardown: torch's gloo threads, destroyed during
    it, sometimes abort a rank that has finished ("terminate called without an active
    exception", about 1 run in 10 here), which would fail a job whose results are
    written. Everything that matters is flushed first."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="fedlb cluster %(message)s")
    try:
        worker(ClusterScenario.from_mapping(json.loads(sys.argv[1])))
    except SystemExit as stop:
        _exit_now(stop.code if isinstance(stop.code, int) else 1)
    _exit_now(0)
