"""The generated pages: the configuration reference from the pydantic model
(``kvcomm.config.Config``) and the command-line reference from the argparse parser
(``kvcomm.cli.build_parser``), and the list of ``kvcomm.aio``'s awaited faces of the sync
client's methods (made when that module loads, so the API generator reading the source
does not see them), made at build time so that none can drift from the code.

A page asks for one with a marker line of its own, ``<!-- generated: config -->``,
``<!-- generated: cli -->`` or ``<!-- generated: aio -->``; mkdocs calls
``on_page_markdown`` for every page (``hooks:`` in mkdocs.yml) and the marker is replaced
by the tables. ``on_page_content`` drops the Sphinx roles the API page's docstrings
carry. A marker that cannot be filled raises, so ``mkdocs build --strict`` fails rather
than publish a page without them.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

import yaml

MARKER = re.compile(r"^<!-- generated: (config|cli|aio) -->$", re.MULTILINE)
# a Sphinx role left before a code span by a docstring (":class:`Config`"): the API page
# reads docstrings as markdown, where the role would show as text
ROLE = re.compile(r":(?:class|func|meth|mod|attr|exc|data|obj|const):(?=<code>)")


def on_page_markdown(markdown: str, **_: Any) -> str:
    return MARKER.sub(lambda m: _GENERATORS[m.group(1)](), markdown)


def on_page_content(html: str, **_: Any) -> str:
    return ROLE.sub("", html)


def _cell(text: Any) -> str:
    """Text for one cell of a markdown table: one line, pipes escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


# -- the configuration ------------------------------------------------------------------

def _kind(info: Any) -> str:
    """What a key takes, as a reader of the YAML file writes it."""
    for meta in info.metadata:
        name = getattr(getattr(meta, "func", None), "__name__", "")
        if name == "parse_size":
            return "size"
        if name == "parse_duration":
            return "duration"
        if name == "parse_permissions":
            return "file mode"
    text = str(info.annotation)
    for pattern, kind in (
        (r"^<class '(\w+)'>$", r"\1"),
        (r"^typing\.Literal\[(.*)\]$", r"one of \1"),
        (r"^list\[.*\]$", "list"),
        (r"^dict\[.*\]$", "mapping"),
    ):
        if re.match(pattern, text):
            return re.sub(pattern, kind, text).replace("'", "")
    return re.sub(r"typing\.|Annotated\[|, .*", "", text).replace("NoneType", "null")


def _bounds(info: Any) -> str:
    """The key's numeric and length bounds, as ``ge 1, le 3600``."""
    words = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "min_length": "length ≥",
             "max_length": "length ≤", "pattern": "matches"}
    shown = []
    for meta in info.metadata:
        for attr, word in words.items():
            value = getattr(meta, attr, None)
            if value is None or (attr == "le" and value == (1 << 63) - 1):
                continue  # every count's le is the int64 limit: not worth a cell
            shown.append(f"{word} `{value}`" if attr == "pattern" else f"{word} {value:,}"
                         if isinstance(value, int) else f"{word} {value}")
    return ", ".join(shown)


def _yaml_value(value: Any) -> str:
    """A default as one line of YAML, as it would be written in the config file."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 16).strip()
    return text.removesuffix("...").strip()


def config_reference() -> str:
    from kvcomm.config import Config

    # the defaults as `kvcomm config` prints them: sizes and durations in their units
    defaults = yaml.safe_load(Config().to_yaml())
    out = []
    for section, section_info in Config.model_fields.items():
        model = section_info.annotation
        out += [f"### `{section}`", "", "| key | takes | default | bounds | meaning |",
                "| --- | --- | --- | --- | --- |"]
        for name, info in model.model_fields.items():
            default = defaults.get(section, {}).get(name, None)
            shown = "unset" if default is None else f"`{_yaml_value(default)}`"
            out.append(f"| `{section}.{name}` | {_cell(_kind(info))} | {_cell(shown)} | "
                       f"{_cell(_bounds(info))} | {_cell(info.description or '')} |")
        out.append("")
    return "\n".join(out)


# -- the command line -------------------------------------------------------------------

def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    """(name, parser, one-line help) of each subcommand, in the order they were added."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                found.append((name, sub, helps.get(name, "")))
    return found


def _option(parser: argparse.ArgumentParser, action: argparse.Action) -> tuple[str, str]:
    if action.option_strings:
        names = ", ".join(f"`{o}`" for o in action.option_strings)
        if action.nargs != 0:
            metavar = action.metavar or (
                "{" + ",".join(map(str, action.choices)) + "}" if action.choices
                else action.dest.upper())
            names += f" `{metavar}`"
    else:
        names = f"`{action.metavar or action.dest}`"
    text = parser._get_formatter()._expand_help(action) if action.help else ""
    return names, text


def _command(prog: str, parser: argparse.ArgumentParser, summary: str, depth: int) -> list[str]:
    out = [f"{'#' * depth} `{prog}`", ""]
    if parser.description or summary:
        out += [" ".join((parser.description or summary).split()), ""]
    usage = parser.format_usage().removeprefix("usage: ").strip()
    out += ["```", usage, "```", ""]
    rows = [_option(parser, a) for a in parser._actions
            if a.help is not argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)
            and not isinstance(a, argparse._SubParsersAction)]
    if rows:
        out += ["| option | meaning |", "| --- | --- |"]
        out += [f"| {_cell(n)} | {_cell(t)} |" for n, t in rows]
        out.append("")
    for name, sub, help_ in _subparsers(parser):
        out += _command(f"{prog} {name}", sub, help_, min(depth + 1, 6))
    return out


def cli_reference() -> str:
    from kvcomm.cli import build_parser

    parser = build_parser()
    out = []
    for name, sub, help_ in _subparsers(parser):
        out += _command(f"kvcomm {name}", sub, help_, 3)
    return "\n".join(out)


def aio_reference() -> str:
    """A table of kvcomm.aio.AsyncClient's awaited faces: each sync method's name, its
    signature and the first line of its docstring (the whole on kvcomm.Client's entry)."""
    import inspect

    import kvcomm.aio
    from kvcomm._client.client import Client

    rows = []
    for name, fn in sorted(kvcomm.aio._public(Client).items()):
        if name in kvcomm.aio._OWN_FACES:
            continue
        face = getattr(kvcomm.aio.AsyncClient, name)
        if not inspect.iscoroutinefunction(face):
            raise RuntimeError(f"kvcomm.aio.AsyncClient.{name} is not awaited")
        sig = inspect.signature(fn)
        shown = sig.replace(parameters=[p for p in sig.parameters.values()
                                        if p.name != "self" and not p.name.startswith("_")])
        first = (fn.__doc__ or "").strip().split("\n\n")[0]
        # (a pipe in a code span does not split the row: written as it is there)
        rows.append(f"| `await kv.{name}{' '.join(str(shown).split())}` | {_cell(first)} "
                    f"([kvcomm.Client.{name}](#kvcomm.Client.{name})) |")
    if not rows:
        raise RuntimeError("kvcomm.aio.AsyncClient has no awaited faces")
    return "\n".join(["| awaited | what it does (the sync method's docstring) |",
                      "| --- | --- |", *rows])


_GENERATORS = {"config": config_reference, "cli": cli_reference, "aio": aio_reference}
