"""Torch kept fork-safe in the processes that fork warm ClientApps, ServerApps and
simulations (fedlb.deploy.warm), and a tripwire that keeps it so.

PyTorch's fork rules, each seen on real hardware (`../shared/notes/gpu-h200-federation.md`,
and the checks in `docs/flower/framework-time.md`, "Fork safety"):
- a child forked from a process that initialised CUDA cannot use CUDA ("CUDA error:
  initialization error", "Cannot re-initialize CUDA in forked subprocess"), and
  `torch.cuda.is_available()` alone already initialises the driver (cuInit) unless
  PYTORCH_NVML_BASED_CUDA_CHECK=1;
- a child forked after the parent's autograd engine started its device threads cannot
  run backward ("Unable to handle autograd's threading in combination with fork-based
  multiprocessing"); a CUDA build starts them at the first backward, whatever device the
  tensors are on;
- a child forked after torch's intra-op (OpenMP) threads ran hangs at its first parallel
  op (GNU OpenMP has no fork handler; here a LeNet forward in the parent hung every child).
A CPU-only torch build shows only the last: the first two are invisible on it, so the
warm path is kept out of them by construction and checked by a tripwire, not by luck.

What a forking process does here (`arm`, then `warm_up_for_forks`, then `hazards` before
every fork):
- the tripwire: autograd's entry (`Variable._execution_engine.run_backward`, what
  Tensor.backward and torch.autograd.grad reach), CUDA's initialisation
  (`torch.cuda._lazy_init`, which `torch.cuda.init` and a tensor's first CUDA use call)
  and the CUDA runtime's device count (cuInit) raise ForkSafetyError naming what called them
  (the first frame outside torch), and the attempt is remembered;
- torch runs one intra-op thread, and `is_available()` asks NVML, not the CUDA runtime;
- `hazards()`: what would break a forked child (a remembered trip, CUDA initialised
  here, this process forked from one that had, more intra-op threads), and what its
  parent had at the fork. The warm server forks only while it is empty;
- every child forked from an armed process gets torch's own functions, thread count and
  environment back before it runs anything (an `os.register_at_fork` handler), so a
  ClientApp trains, runs backward and uses its GPU as in a fresh process.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"  # torch's switch: is_available() without cuInit
ADVICE = (
    "do it inside the app's functions (they run in each message's fork), not at import "
    "or in a --preload module"
)


class ForkSafetyError(RuntimeError):
    """Torch used, in a process that forks workers, in a way a forked child cannot inherit."""


@dataclass
class _Tripwire:
    """This process's tripwire (module state: a forked child inherits a copy)."""

    armed: bool = False
    tripped: list[str] = field(default_factory=list)  # what tripped it, and where
    modules: dict[str, str] = field(default_factory=dict)  # module -> why its import failed
    originals: dict[tuple[Any, str], Any] = field(default_factory=dict)  # (owner, name) -> obj
    threads: int = 0  # torch's intra-op threads before arming, given back to each child
    environment: str | None = None  # NVML_CHECK before arming (None: unset)
    at_fork: list[str] = field(default_factory=list)  # hazards when this process last forked
    inherited: list[str] = field(default_factory=list)  # the parent's `at_fork`, in a child
    handler: bool = False  # the os.register_at_fork handlers are in place


_WIRE = _Tripwire()


class _GuardedEngine:
    """Autograd's engine as the armed process sees it: running backward trips, every
    other attribute (queue_callback, is_checkpoint_valid, ...) is the engine's own."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def run_backward(self, *args: Any, **kwargs: Any) -> Any:
        _trip("autograd's backward", "cannot run backward on a CUDA build of torch")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def _caller() -> str:
    """The innermost frame outside torch and this module: who asked for it."""
    torch_dir = str(Path(importlib.import_module("torch").__file__ or "").parent) + os.sep
    for frame in reversed(traceback.extract_stack()):  # innermost first
        if frame.filename != __file__ and not frame.filename.startswith(torch_dir):
            return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return "torch itself"


def _trip(what: str, consequence: str) -> NoReturn:
    where = _caller()
    _WIRE.tripped.append(f"{what} at {where}")
    raise ForkSafetyError(
        f"fedlb: {what} at {where}, in a process that forks ClientApps (or ServerApps): "
        f"a child forked after it {consequence} (PyTorch's fork rules); {ADVICE}, or run "
        "with --cold"
    )


def _tripping(what: str, consequence: str) -> Callable[..., Any]:
    def tripped(*_args: Any, **_kwargs: Any) -> NoReturn:
        _trip(what, consequence)

    return tripped


def _replace(owner: Any, name: str, replacement: Any) -> None:
    _WIRE.originals[(owner, name)] = getattr(owner, name)
    setattr(owner, name, replacement)


def arm() -> None:
    """Arm the tripwire in this process, which is about to fork workers (a no-op when
    armed already). Import torch first, and arm before anything else uses it."""
    import torch
    from torch.autograd.variable import Variable

    if _WIRE.armed:
        return
    _replace(Variable, "_execution_engine", _GuardedEngine(Variable._execution_engine))
    cuda_init = _tripping("CUDA's initialisation", "cannot use CUDA")
    original_init = torch.cuda._lazy_init
    # torch.cuda.random (and any module that imported it by name) holds its own reference
    for name, module in list(sys.modules.items()):
        if name.startswith("torch.cuda") and getattr(module, "_lazy_init", None) is original_init:
            _replace(module, "_lazy_init", cuda_init)
    if hasattr(torch._C, "_cuda_getDeviceCount"):  # a CUDA build: the runtime's cuInit
        _replace(
            torch._C,
            "_cuda_getDeviceCount",
            _tripping("the CUDA runtime's device count (cuInit)", "cannot use CUDA"),
        )
    _WIRE.threads = torch.get_num_threads()
    torch.set_num_threads(1)  # no OpenMP threads here for a child to inherit half of
    _WIRE.environment = os.environ.get(NVML_CHECK)
    os.environ[NVML_CHECK] = "1"
    _WIRE.armed = True
    if not _WIRE.handler:
        os.register_at_fork(before=_before_fork, after_in_child=_in_child)
        _WIRE.handler = True


def disarm() -> None:
    """Torch's own functions, thread count and environment back in this process."""
    if not _WIRE.armed:
        return
    for (owner, name), original in _WIRE.originals.items():
        setattr(owner, name, original)
    _WIRE.originals.clear()
    import torch

    torch.set_num_threads(_WIRE.threads)
    os.environ.pop(NVML_CHECK, None)
    if _WIRE.environment is not None:
        os.environ[NVML_CHECK] = _WIRE.environment
    _WIRE.armed = False


def armed() -> bool:
    return _WIRE.armed


def _before_fork() -> None:
    if _WIRE.armed:
        _WIRE.at_fork = hazards()


def _in_child() -> None:
    """Right after a fork, in the child: what its parent had at the fork, and torch as a
    fresh process has it (the child is the worker, not a forking process)."""
    _WIRE.inherited = list(_WIRE.at_fork)  # the parent's trips among them: not the child's
    _WIRE.tripped, _WIRE.at_fork = [], []
    disarm()


def hazards() -> list[str]:
    """Why a child forked from this process now would fail (empty: it would not)."""
    import torch

    found = list(_WIRE.tripped)
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        found.append("CUDA is initialised in this process")
    if torch.cuda._is_in_bad_fork():
        found.append("this process was forked from one that had initialised CUDA")
    if _WIRE.armed and torch.get_num_threads() != 1:
        found.append(
            f"torch's intra-op threads were set to {torch.get_num_threads()} here (an op "
            "run with them starts OpenMP threads, and a child forked after that hangs)"
        )
    found += [f"{hazard} (in the process this one was forked from)" for hazard in _WIRE.inherited]
    return list(dict.fromkeys(found))


def state() -> str:
    """One line on this process's fork safety, for its log (tests read it)."""
    import torch

    tripped = "; ".join(_WIRE.tripped) or "nothing"
    cuda = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    inherited = "; ".join(_WIRE.inherited)
    return (
        f"tripwire {'armed' if _WIRE.armed else 'NOT armed'}, tripped by {tripped}, "
        f"CUDA initialised: {'yes' if cuda else 'no'}, "
        f"intra-op threads: {torch.get_num_threads()}"
        + (f", forked from a process that had: {inherited}" if inherited else "")
    )


def import_modules(modules: Sequence[str]) -> list[str]:
    """Import `modules` in the armed process; those not imported (returned) tripped the
    tripwire (a --preload module that trains at import): remembered, not raised, so the
    process forks nothing (`hazards`), and a child of it skips them rather than trip
    again. An import's own error (a module not found) is raised."""
    skipped = []
    for module in modules:
        if module in _WIRE.modules:
            skipped.append(module)
            continue
        before = len(_WIRE.tripped)
        try:
            importlib.import_module(module)
        except Exception as error:
            if len(_WIRE.tripped) == before:  # not the tripwire's: the import's own error
                raise
            _WIRE.modules[module] = str(error)
            skipped.append(module)
    return skipped


def warm_up_for_forks() -> None:
    """Pay torch's one-time costs that a forked child inherits, without autograd, CUDA or
    intra-op threads: building an optimizer and its first step (~1.2 s in a fresh process
    here, 5.5 s on an H200 machine: all of the old warm-up's worth but its backward) with
    the gradient set by hand, which never reaches autograd's engine. Each forked child
    pays its own first backward: ~3 ms here (CPU-only torch), ~0.2 s on the H200
    machine's CUDA build, where it initialises CUDA's driver and starts autograd's device
    threads (docs/flower/framework-time.md, "Fork safety")."""
    import torch

    weight = torch.zeros(1, requires_grad=True)
    optimiser = torch.optim.SGD([weight], lr=0.1)
    weight.grad = torch.ones(1)
    optimiser.step()


def child_environment() -> dict[str, str]:
    """The environment for a process started afresh from this one (a cold ClientApp):
    the user's, without what arming set."""
    environment = dict(os.environ)
    if not _WIRE.armed:
        return environment
    environment.pop(NVML_CHECK, None)
    if _WIRE.environment is not None:
        environment[NVML_CHECK] = _WIRE.environment
    return environment
