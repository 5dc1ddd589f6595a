"""The live page's options, shared by `fedlb server`, `fedlb demo` and `fedlb experiment`,
and the page served while a command runs (fedlb.page)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Annotated

import typer

from fedlb._markup import plain
from fedlb.page import MIN_TOKEN, LivePage, PageError, PageState, is_loopback

from .common import UsageError, console

PANEL = "Live page"
_PAGE_ON = typer.Option(
    "--page/--no-page",
    help="Serve a live page of the run (silos, rounds, charts, events) while it runs; "
    "--no-page: none.",
    rich_help_panel=PANEL,
)
_PAGE_HOST = typer.Option(
    "--page-host",
    help="Where the page listens: this machine only by default; any other address "
    "needs --page-token.",
    rich_help_panel=PANEL,
)
_PAGE_PORT = typer.Option(
    "--page-port", help="The page's port (0: a free one).", rich_help_panel=PANEL
)
PageOn = Annotated[bool, _PAGE_ON]
PageHost = Annotated[str, _PAGE_HOST]
PagePort = Annotated[int, _PAGE_PORT]
# `fedlb server`'s: None where not given, so that its --config's [server] table can say
# (page, page-host, page-port; the defaults above otherwise)
PageOnOrFile = Annotated[bool | None, _PAGE_ON]
PageHostOrFile = Annotated[str | None, _PAGE_HOST]
PagePortOrFile = Annotated[int | None, _PAGE_PORT]
PageToken = Annotated[
    str | None,
    typer.Option(
        "--page-token",
        envvar="FEDLB_PAGE_TOKEN",
        help=f"A secret of at least {MIN_TOKEN} characters every request to the page must "
        "carry (?token=...); needed with --page-host.",
        rich_help_panel=PANEL,
    ),
]


@contextlib.contextmanager
def live_page(
    enabled: bool, host: str, port: int, token: str | None, title: str
) -> Iterator[PageState | None]:
    """The page's state, served from here until the block ends (None with --no-page); its
    address printed once it listens. A usage error for an exposed page without a token or
    a port it cannot have."""
    if not enabled:
        yield None
        return
    state = PageState(title)
    try:
        page = LivePage(state, host, port, token).start()
    except PageError as error:
        raise UsageError(str(error)) from None
    where = "this machine only" if is_loopback(host) else f"on {plain(host)}, with its token"
    console.print(f"[bold]live page[/]: {plain(page.url)} ({where}; --no-page: none)")
    try:
        yield state
    finally:
        page.stop()
