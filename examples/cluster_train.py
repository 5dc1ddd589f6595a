"""Load-balanced data-parallel training in your own script: the lines marked `fedlb`.

    torchrun --standalone --nproc-per-node 4 examples/cluster_train.py --iterations 200

Each rank draws its batches from the whole dataset at the size the coordinator gives it,
gradients are averaged weighted by those sizes (every sample counts the same), and the
sizes follow the ranks' measured speeds. Nothing else in the loop changes. Pass
--slowdowns 1,1,2,4 to make the ranks of this one machine unequal (sleep-padded). On a
machine with a GPU per rank it trains there with NCCL (--device cpu to stay on the CPU).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fedlb.cluster import LoadBalancer  # fedlb
from fedlb.data import load_digits
from fedlb.training import choose_device, process_group_backend, tensor_dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--slowdowns", default="", help="one factor per rank, e.g. 1,1,2,4")
    parser.add_argument("--device", default="auto", help="auto (cuda:LOCAL_RANK if any), cpu")
    args = parser.parse_args()

    device = choose_device(args.device)  # cuda:LOCAL_RANK where there are GPUs
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(process_group_backend(device))  # NCCL on GPUs, else gloo
    torch.set_num_threads(1)
    rank = dist.get_rank()
    data = load_digits()
    dataset = tensor_dataset(data.x, data.y)
    torch.manual_seed(0)
    network = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    model = DistributedDataParallel(
        network.to(device), device_ids=[device.index] if device.type == "cuda" else None
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    pace = None
    if args.slowdowns:  # emulate a slower machine: an iteration of B samples takes B/v s
        speed = 400.0 / float(args.slowdowns.split(",")[rank])

        def pace(real_s: float, batch: int) -> float:
            return max(real_s, batch / speed)

    balancer = LoadBalancer(model, dataset, args.batch_size, pace=pace)  # fedlb: batches on device
    for step, (x, y) in enumerate(balancer.batches(args.iterations)):  # fedlb
        loss: torch.Tensor = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        if rank == 0 and step % 50 == 0:
            print(f"step {step}: loss {loss.item():.3f}, sizes {balancer.coordinator.sizes}")
    balancer.close()  # fedlb
    if rank == 0:
        print(f"final sizes {balancer.coordinator.sizes} (X = {balancer.coordinator.total})")
    del balancer, model, optimizer  # before the process group they use
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Skip the interpreter's teardown: torch's gloo threads destroyed in it sometimes abort a
    # finished rank ("terminate called without an active exception"); nothing is lost here.
    sys.stdout.flush()
    os._exit(0)
