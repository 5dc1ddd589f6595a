"""What a warm server's torch warm-up buys its forked ClientApps, and what the fork-safe
warm-up (fedlb.deploy.fork_safety) moved into each of them (clock: time.perf_counter).

    .venv/bin/python benchmarks/fork_warm_up.py [--children 20] [--rounds 3]

For each way the forking process can warm torch up, a fresh Python imports what a warm
silo's server imports (torch, Flower's ClientApp runtime, fedlb's ClientApp), warms up,
and forks children one after the other. Each child does what a ClientApp's first train
message does to torch, on one intra-op thread: `warm_up_torch()` (what balance_mod calls
before the app's handler: a backward and an optimizer step; the child's first backward
is in it), then builds LeNet-5 and runs one SGD step at B = 32 (28x28). Reported, as the
median of the children and its spread over `--rounds` fresh parents, in milliseconds:
- `child_first_backward_ms`: the child's warm_up_torch(): the cost moved into each child;
- `fork_to_first_step_ms`: from the fork to the end of that first step.
Ways: `autograd` (the parent runs backward: fedlb before issue 36, which a CUDA build
cannot fork from), `fork-safe` (arm the tripwire, `warm_up_for_forks`: now), `none`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WAYS = ("autograd", "fork-safe", "none")


def parent(way: str, children: int) -> list[dict[str, float]]:
    """In a fresh process: import, warm up `way`, fork `children` children in turn."""
    import torch

    import fedlb.deploy.client_app  # noqa: F401  (what the warm silo's server imports)
    from fedlb.deploy import fork_safety
    from fedlb.flower import warm_up_torch
    from fedlb.models import build_model

    if way == "autograd":
        warm_up_torch()
    elif way == "fork-safe":
        fork_safety.arm()
        fork_safety.warm_up_for_forks()
    timings = []
    for _ in range(children):
        read, write = os.pipe()
        forked = time.perf_counter()
        pid = os.fork()
        if pid == 0:  # the child: what a ClientApp's first train message does to torch
            os.close(read)
            torch.set_num_threads(1)
            started = time.perf_counter()
            warm_up_torch()
            backward = time.perf_counter() - started
            model = build_model("lenet5", (1, 28, 28), 10, 0)
            optimiser = torch.optim.SGD(model.parameters(), lr=0.01)
            x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            optimiser.step()
            result = {
                "child_first_backward_ms": 1e3 * backward,
                "fork_to_first_step_ms": 1e3 * (time.perf_counter() - forked),
            }
            os.write(write, json.dumps(result).encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as reply:
            timings.append(json.loads(reply.read()))
        os.waitpid(pid, 0)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--children", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parent", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.parent is not None:  # one fresh parent (run by the loop below)
        print(json.dumps(parent(args.parent, args.children)))
        return
    medians: dict[str, dict[str, list[float]]] = {way: {} for way in WAYS}
    for _ in range(args.rounds):
        for way in WAYS:  # interleaved: drift on a shared machine hits every way alike
            command = [sys.executable, __file__, "--parent", way, "--children", str(args.children)]
            timings = json.loads(subprocess.run(command, check=True, capture_output=True).stdout)
            for key in timings[0]:
                median = statistics.median(t[key] for t in timings)
                medians[way].setdefault(key, []).append(median)
    summary = {
        way: {
            key: {
                "median": round(statistics.median(v), 2),
                "min": round(min(v), 2),
                "max": round(max(v), 2),
            }
            for key, v in keys.items()
        }
        for way, keys in medians.items()
    }
    print(json.dumps({"children": args.children, "rounds": args.rounds, "ways": summary}, indent=1))


if __name__ == "__main__":
    main()
