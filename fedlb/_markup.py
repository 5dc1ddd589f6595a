"""Text from outside (a silo's label, curve or failure, a file's key or value, a path, an
error's message) printed through rich: shown as it is, never read as markup.

rich reads `[...]` in any string it prints as markup: a silo whose curve name held `[/x]`
crashed the server's round table with MarkupError, and `[bold]` in a key would restyle
the listing. Every outside string fedlb prints through rich goes through `plain` first;
fedlb's own markup (`[red]...[/]`) stays around it. Not for what rich does not parse as
markup (log records, typer's error panels): there the escaping backslashes would show.
"""

from __future__ import annotations

from rich.markup import escape


def plain(value: object) -> str:
    """`value` as text that rich prints literally, whatever brackets it holds."""
    return escape(str(value))
