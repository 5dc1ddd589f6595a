"""An outside witness of torch's use, for tests/test_warm_fork_safety.py.

Python imports `sitecustomize` at start-up from sys.path, so every process started with
this folder on PYTHONPATH (a silo's launcher, its warm server, each task, Flower's own
processes) runs this. Where FEDLB_FORK_AUDIT names a file, torch is wrapped the moment it
is imported: each call of autograd's run_backward and of CUDA's initialisation appends
a line `pid role what` to that file, role being the process's name (fedlb-warm,
fedlb-task, ...), `fedlb-launcher` for `python -m fedlb.deploy.warm`, else `other`. It
sits below fedlb's own tripwire and does not trust it: a forking process that ran
backward or initialised CUDA before arming, or without, is on record here.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
from typing import Any

AUDIT = os.environ.get("FEDLB_FORK_AUDIT")


def _role() -> str:
    with open("/proc/self/comm") as comm:
        name = comm.read().strip()
    if name.startswith("fedlb-"):
        return name
    with open("/proc/self/cmdline", "rb") as cmdline:
        arguments = cmdline.read().split(b"\0")
    return "fedlb-launcher" if b"fedlb.deploy.warm" in arguments else "other"


def _record(what: str) -> None:
    assert AUDIT is not None
    with open(AUDIT, "a") as out:
        out.write(f"{os.getpid()} {_role()} {what}\n")


class _Engine:
    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def run_backward(self, *args: Any, **kwargs: Any) -> Any:
        _record("backward")
        return self._engine.run_backward(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def _witness(torch: Any) -> None:
    from torch.autograd.variable import Variable

    Variable._execution_engine = _Engine(Variable._execution_engine)
    cuda_init = torch.cuda._lazy_init

    def recorded_init() -> Any:
        _record("cuda-init")
        return cuda_init()

    for name, module in list(sys.modules.items()):
        if name.startswith("torch.cuda") and getattr(module, "_lazy_init", None) is cuda_init:
            module._lazy_init = recorded_init


class _WhenTorchIsImported:
    """A meta path finder that lets torch import as usual, then wraps it (once)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def execute_and_witness(module: Any) -> None:
            execute(module)
            _witness(module)

        spec.loader.exec_module = execute_and_witness  # type: ignore[method-assign]
        return spec


if AUDIT:
    sys.meta_path.insert(0, _WhenTorchIsImported())
