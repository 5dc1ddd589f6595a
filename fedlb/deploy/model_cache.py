"""The silo's model kept on its device between the messages one process serves.

A ClientApp that builds its model each message pays, on a GPU, the model's construction
and its transfer to the device every round. In a process that serves several messages (a
resident worker, fedlb.deploy.resident; Flower's simulation) the model built for one
message is kept here, on its device, and the next message's weights are copied into it
(`load_state_dict` copies in place): the same values in the same parameters as a freshly
built model with those weights loaded, so training is bit-identical (SGD's state is made
per round: fedlb.training.train_epoch). In a fork per message this cache starts empty
each time, and nothing changes.

What determines the model is its key: the run's model, seed, the samples' shape, the
number of classes and the device. One model is kept (a run of another model replaces
it), so a GPU holds at most one idle model. A model is taken out while a message uses it
and put back after: two threads of one process (Flower's in-process simulation) never
share one, and a message that failed leaves none behind.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from fedlb.data import LabelledData

from .run_config import RunConfig
from .task import model_for

ModelKey = tuple[str, int, tuple[int, ...], int, str]


@dataclass
class CacheCounts:
    """How many models this process built and reused (the resident worker's log says)."""

    built: int = 0
    reused: int = 0


COUNTS = CacheCounts()
_MODELS: dict[ModelKey, nn.Module] = {}
_LOCK = threading.Lock()


def model_key(config: RunConfig, data: LabelledData, device: torch.device) -> ModelKey:
    return (config.model, config.seed, tuple(data.x.shape[1:]), data.num_classes, str(device))


@contextmanager
def resident_model(
    config: RunConfig,
    data: LabelledData,
    device: torch.device,
    state: Mapping[str, torch.Tensor],
) -> Iterator[nn.Module]:
    """The run's model on `device` with the weights `state` (on the CPU) loaded: the one
    this process kept, or a fresh one; kept again once the caller is done with it."""
    key = model_key(config, data, device)
    with _LOCK:
        model = _MODELS.pop(key, None)
    if model is None:
        model = model_for(config, data)
        model.load_state_dict(state)
        model.to(device)
        COUNTS.built += 1
    else:
        model.load_state_dict(state)  # copies into the parameters where they are
        model.zero_grad(set_to_none=True)  # as a fresh model: no gradients
        model.train()
        COUNTS.reused += 1
    yield model  # an exception leaves the model out: the next message builds afresh
    with _LOCK:
        _MODELS.clear()  # one model at a time (another run's is dropped)
        _MODELS[key] = model


def cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights in host memory (copied off its device; on the CPU, its own
    tensors), the model itself left where it is."""
    return {name: tensor.detach().to("cpu") for name, tensor in model.state_dict().items()}


def forget() -> None:
    """Drop the kept model (tests)."""
    with _LOCK:
        _MODELS.clear()
