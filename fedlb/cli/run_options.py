"""One option per run setting (RunConfig's fields) for the commands that start a run:
`fedlb server` and `fedlb demo`, each option's default said as that command's own (the
demo changes a few: `fedlb.cli.demo.DEMO_RUN`)."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Annotated, Any

import typer
from rich.markup import escape

from fedlb.deploy import RunConfig

RUN_TYPES = {"int": int, "float": float, "str": str}
CLI_OWNED = {"out_dir", "resume"}  # run settings the commands set themselves


def _run_options(defaults: Mapping[str, Any]) -> list[inspect.Parameter]:
    """One --flag per run setting (default None: the config file's, else the command's
    `defaults`, else RunConfig's), its help showing the default the command runs with."""
    params = []
    for f in fields(RunConfig):
        if f.name in CLI_OWNED:
            continue
        key = f.name.replace("_", "-")
        flag = "--" + key
        kind = RUN_TYPES[str(f.type)]
        shown = defaults.get(key, f.default)
        params.append(
            inspect.Parameter(
                f.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=None,
                annotation=Annotated[
                    kind | None,
                    typer.Option(
                        flag,
                        # [default: ...] escaped: --help reads help texts as rich markup
                        help=escape(f"{RunConfig.HELP[key]} [default: {shown}]"),
                        rich_help_panel="Run settings",
                    ),
                ],
            )
        )
    return params


def with_run_options(
    function: Callable[..., None], defaults: Mapping[str, Any] | None = None
) -> Callable[..., None]:
    """Give a command one option per RunConfig field, collected into `run_flags` (only
    those given); `defaults` ({"num-rounds": 8}) are the settings the command itself
    runs with where RunConfig's differ, shown as the options' defaults."""
    hints = typing.get_type_hints(function, include_extras=True)  # annotations are strings
    own = [
        p.replace(annotation=hints[p.name])
        for p in inspect.signature(function).parameters.values()
        if p.name != "run_flags"
    ]
    run_names = [f.name for f in fields(RunConfig) if f.name not in CLI_OWNED]

    def command(**kwargs: Any) -> None:
        flags = {n.replace("_", "-"): kwargs.pop(n) for n in run_names}
        function(run_flags={k: v for k, v in flags.items() if v is not None}, **kwargs)

    command.__signature__ = inspect.Signature(own + _run_options(defaults or {}))  # type: ignore[attr-defined]
    command.__doc__ = function.__doc__
    command.__name__ = function.__name__
    return command
