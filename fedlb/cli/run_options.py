"""One option per run setting (RunConfig's fields) for the commands that start a run:
`fedlb server` and `fedlb demo`."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from dataclasses import fields
from typing import Annotated, Any

import typer

from fedlb.deploy import RunConfig

RUN_TYPES = {"int": int, "float": float, "str": str}
CLI_OWNED = {"out_dir", "resume"}  # run settings the commands set themselves


def _run_options() -> list[inspect.Parameter]:
    """One --flag per run setting (default None: the config file's or RunConfig's)."""
    params = []
    for f in fields(RunConfig):
        if f.name in CLI_OWNED:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = RUN_TYPES[str(f.type)]
        params.append(
            inspect.Parameter(
                f.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=None,
                annotation=Annotated[
                    kind | None,
                    typer.Option(
                        flag,
                        help=f"{RunConfig.HELP[flag[2:]]} [default: {f.default}]",
                        rich_help_panel="Run settings",
                    ),
                ],
            )
        )
    return params


def with_run_options(
    function: Callable[..., None],
) -> Callable[..., None]:
    """Give a command one option per RunConfig field, collected into `run_flags`."""
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

    command.__signature__ = inspect.Signature(own + _run_options())  # type: ignore[attr-defined]
    command.__doc__ = function.__doc__
    command.__name__ = function.__name__
    return command
