"""Text from outside (a silo's label, curve or failure, a file's key or value, a path, an
error's message) printed: shown as it is, never read as markup nor as a terminal's
control sequence.

rich reads `[...]` in any string it prints as markup: a silo whose curve name held `[/x]`
crashed the server's round table with MarkupError, and `[bold]` in a key would restyle
the listing. Every outside string fedlb prints through rich goes through `plain` first;
fedlb's own markup (`[red]...[/]`) stays around it. Not for what rich does not parse as
markup (log records, typer's error panels): there the escaping backslashes would show;
those take `visible` alone.

A terminal obeys the control characters in what it prints: ESC sequences recolour or
clear the screen, OSC 8 makes a hyperlink, a bare CR overwrites the line. A silo chooses
its error's text and its metrics' names, so every such string reaches the operator's
console with its control characters written out (`visible`: ESC as `\\x1b`), in the log
as in the round table (issue 56).
"""

from __future__ import annotations

from rich.markup import escape


def visible(value: object, lines: bool = False) -> str:
    """`value` as text with every character a terminal would act on or hide written out
    as Python writes it in a string literal (ESC -> `\\x1b`, U+009B -> `\\x9b`, a bidi
    override -> `\\u202e`): C0 and C1 controls, DEL, format and other non-printing
    characters. `lines`: newlines and tabs are kept (a log's tail, many lines of it);
    else they are written out too, so one silo's line stays one line."""
    text = str(value)
    if text.isprintable():
        return text
    kept = "\n\t" if lines else ""
    return "".join(c if c.isprintable() or c in kept else repr(c)[1:-1] for c in text)


def plain(value: object) -> str:
    """`value` as text that rich prints literally: whatever brackets it holds, and its
    control characters written out (`visible`, newlines kept)."""
    return escape(visible(value, lines=True))
