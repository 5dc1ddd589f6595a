"""How soon Flower retries an object it pulled and did not find (the SuperNode loop's, the
ClientApp runtime's, the ServerApp grid's pulls)."""

from __future__ import annotations

import functools
from types import ModuleType

from .modules import CLIENTAPP_RUNTIME, SERVERAPP_GRID, SUPERNODE_LOOP, module


def first_retry_after(owner: object, name: str, backoff: float) -> None:
    """Bind `initial_backoff=backoff` to Flower's object-pull function that `owner` (a
    module) imported as `name` (once: a second call replaces the first binding).

    Flower 1.42's `pull_objects` and `pull_and_inflate_object_from_tree`
    (flwr/supercore/inflatable/inflatable_utils.py) retry a missing object after
    `initial_backoff` s, 1 s by default; the modules that call them imported them by name."""
    pull = getattr(owner, name)
    original = pull.func if isinstance(pull, functools.partial) else pull
    setattr(owner, name, functools.partial(original, initial_backoff=backoff))


def supernode_object_pulls(backoff: float, loop: ModuleType | None = None) -> None:
    """The SuperNode loop pulls a message's objects through its module's `pull_objects`."""
    first_retry_after(loop or module(SUPERNODE_LOOP), "pull_objects", backoff)


def clientapp_object_pulls(backoff: float) -> None:
    """The ClientApp runtime pulls its message through its module's
    `pull_and_inflate_object_from_tree`."""
    first_retry_after(module(CLIENTAPP_RUNTIME), "pull_and_inflate_object_from_tree", backoff)


def serverapp_reply_pulls(backoff: float) -> None:
    """The ServerApp's grid (`HttpGrid.pull_messages`) pulls a reply's objects through its
    module's `pull_objects`."""
    first_retry_after(module(SERVERAPP_GRID), "pull_objects", backoff)
