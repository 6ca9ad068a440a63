"""Typed configuration trees: fields with one description each, read from YAML, env and flags.

``blockd.config`` declares the daemon's tree (a frozen dataclass of frozen dataclass sections);
this module is the mechanism, which knows no section. A field is declared with
``option(default, "what it does")``; that one description is the flag's ``--help`` line, the
row of the reference table in the docs and the hint of an error about the field. A value is
converted strictly (``"12x"`` is not an integer, ``yes`` is not a string), and a refusal is one
``InvalidArgument`` line that starts with the field and names where the value came from: the
YAML file, the environment variable or the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from blockd.core.errors import InvalidArgument


def option(default: Any = dataclasses.MISSING, doc: str = "", *,
           factory: Callable[[], Any] | None = None) -> Any:
    """A config field with its one description (``--help``, the docs table, error hints)."""
    text = " ".join(doc.split())
    if not text:
        raise TypeError("every config field needs a description")
    if factory is not None:
        return field(default_factory=factory, metadata={"help": text})
    return field(default=default, metadata={"help": text})


def check_address(value: str, where: str) -> None:
    """``host:port`` (``[v6]:port``), port 0..65535; "" is allowed (disabled)."""
    if not value:
        return
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InvalidArgument(f"{where}: expected HOST:PORT with a port in 0..65535, got "
                              f"{value!r}", field=where)


@dataclass(frozen=True)
class Setting:
    """One field of a tree, with its names in every source."""

    section: str
    name: str
    type: Any
    default: Any
    help: str
    prefix: str

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def flag(self) -> str:
        return f"--{self.section}-{self.name}".replace("_", "-")

    @property
    def env(self) -> str:
        return f"{self.prefix}{self.section}_{self.name}".upper()


def sections(root: type) -> list[tuple[str, type]]:
    hints = typing.get_type_hints(root)
    return [(f.name, hints[f.name]) for f in fields(root)]


def settings(root: type, prefix: str) -> Iterator[Setting]:
    """Every field of the tree, in declaration order, with its default and description."""
    for section, cls in sections(root):
        hints = typing.get_type_hints(cls)
        defaults = cls()
        for f in fields(cls):
            yield Setting(section, f.name, hints[f.name], getattr(defaults, f.name),
                          str(f.metadata.get("help", "")), prefix)


def problem(exc: InvalidArgument) -> str:
    """An error's message without its leading field name (``field: ...`` or ``field ...``)."""
    short = exc.field.rpartition(".")[2]
    for start in (f"{exc.field}: ", f"{exc.field} ", f"{short}: "):
        if exc.field and exc.message.startswith(start):
            return exc.message[len(start):]
    return exc.message


def _type_name(typ: Any) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        typ, getattr(typ, "__name__", str(typ)))


def convert(value: Any, typ: Any) -> Any:
    """``value`` (a YAML scalar, or the text of a flag or variable) as ``typ``; ValueError."""
    if isinstance(typ, types.UnionType):  # pragma: no cover - no optional fields today
        typ = typing.get_args(typ)[0]
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if typ is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower() if isinstance(value, str | int) else None
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
    elif typ is int:
        if number and float(value).is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip().replace("_", ""), 0)
            except ValueError:
                pass
    elif typ is float:
        try:
            got = float(value) if number or isinstance(value, str) else math.nan
        except ValueError:
            got = math.nan
        if math.isfinite(got):
            return got
    elif typ is str:
        if isinstance(value, str):
            return value
        if number:
            return str(value)
    else:  # pragma: no cover - every field is one of the four
        return typ(value)
    raise ValueError(f"expected {_type_name(typ)}, got {value!r}")


def closest(word: str, choices: Iterable[str]) -> str:
    """The choice ``word`` is most likely a typo of, or ""."""
    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.75)
    return found[0] if found else ""


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    found = closest(word, choices)
    return f" (did you mean {found}?)" if found else ""


def _hint(table: Mapping[str, Setting], key: str) -> str:
    s = table.get(key)
    return f" ({s.help.rstrip('.')})" if s is not None else ""


def merge(root: type, base: Any, overrides: Mapping[str, Any], source: Callable[[Setting], str],
          origins: dict[str, str], where: str, prefix: str) -> Any:
    """``base`` with ``overrides`` (section -> field -> value) applied.

    The source of every value is recorded in ``origins`` (key -> source), so a refusal names
    where the bad value came from, whichever source set it; ``where`` names this source in an
    error about an unknown key.
    """
    table = {s.key: s for s in settings(root, prefix)}
    names = dict(sections(root))
    for name in overrides:
        if name not in names:
            raise InvalidArgument(f"{name}: unknown section in {where}"
                                  f"{_did_you_mean(str(name), names)}", field=str(name))
    out = {}
    for name in names:
        given = overrides.get(name) or {}
        if not isinstance(given, Mapping):
            raise InvalidArgument(f"{name}: must be a mapping of fields in {where}", field=name)
        changes = {}
        for key, value in given.items():
            s = table.get(f"{name}.{key}")
            if s is None:
                raise InvalidArgument(
                    f"{name}.{key}: unknown field in {where}"
                    f"{_did_you_mean(f'{name}.{key}', [k for k in table if k.startswith(name)])}",
                    field=f"{name}.{key}")
            try:
                changes[s.name] = convert(value, s.type)
            except ValueError as exc:
                raise InvalidArgument(f"{s.key} from {source(s)}: {exc}{_hint(table, s.key)}",
                                      field=s.key) from None
            origins[s.key] = source(s)
        try:
            out[name] = dataclasses.replace(getattr(base, name), **changes)
        except InvalidArgument as exc:
            raise InvalidArgument(f"{exc.field} from {origins.get(exc.field, 'the defaults')}: "
                                  f"{problem(exc)}{_hint(table, exc.field)}",
                                  field=exc.field) from None
    return root(**out)


def from_env(root: type, environ: Mapping[str, str], prefix: str) -> dict[str, dict[str, str]]:
    """``<PREFIX><SECTION>_<FIELD>`` variables as overrides."""
    out: dict[str, dict[str, str]] = {}
    for s in settings(root, prefix):
        if s.env in environ:
            out.setdefault(s.section, {})[s.name] = environ[s.env]
    return out


def unknown_env(root: type, environ: Mapping[str, str], prefix: str,
                others: Iterable[str] = ()) -> list[tuple[str, str]]:
    """Variables named ``<PREFIX>*`` that are neither a field nor one of ``others``: each with
    the closest known name ("" when none is close)."""
    known = [s.env for s in settings(root, prefix)] + list(others)
    return [(name, closest(name.upper(), known)) for name in sorted(environ)
            if name.upper().startswith(prefix) and name not in known]


def add_flags(parser: argparse.ArgumentParser, root: type, prefix: str) -> None:
    """``--config FILE`` and one flag per field, its help the field's description."""
    parser.add_argument("--config", metavar="FILE",
                        help=f"YAML file with any of the sections below ({prefix}* variables "
                             "and flags override it)")
    groups: dict[str, Any] = {}
    docs = dict(sections(root))
    for s in settings(root, prefix):
        if s.section not in groups:
            doc = (docs[s.section].__doc__ or "").strip().splitlines()[0]
            groups[s.section] = parser.add_argument_group(s.section, doc)
        text = f"{s.help} (default: {s.default!r}; ${s.env})"
        groups[s.section].add_argument(s.flag, dest=f"cfg__{s.section}__{s.name}", default=None,
                                       metavar=s.type.__name__.upper(),
                                       help=text.replace("%", "%%"))


def read_yaml(path: str) -> Mapping[str, Any]:
    """The ``--config`` file's sections; a missing, unreadable or malformed file is refused
    in one line (field ``config``)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InvalidArgument(f"config: cannot read --config {path}: {exc.strerror or exc}",
                              field="config") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise InvalidArgument(f"config: {path} is not valid YAML{at}: {what}",
                              field="config") from None
    if not isinstance(data, Mapping):
        raise InvalidArgument(f"config: {path}: the top level must be a mapping of sections",
                              field="config")
    return data


def load(root: type, args: argparse.Namespace | None, environ: Mapping[str, str] | None,
         prefix: str) -> Any:
    """Defaults <- the ``--config`` YAML file <- the environment <- flags."""
    origins: dict[str, str] = {}
    cfg = root()
    path = getattr(args, "config", None) if args is not None else None
    if path:
        cfg = merge(root, cfg, read_yaml(path), lambda s: str(path), origins, str(path), prefix)
    env = os.environ if environ is None else environ
    cfg = merge(root, cfg, from_env(root, env, prefix), lambda s: f"${s.env}", origins,
                "the environment", prefix)
    if args is not None:
        flags: dict[str, dict[str, Any]] = {}
        for key, value in vars(args).items():
            if key.startswith("cfg__") and value is not None:
                _, section, name = key.split("__")
                flags.setdefault(section, {})[name] = value
        cfg = merge(root, cfg, flags, lambda s: s.flag, origins, "the flags", prefix)
    return cfg


def markdown_table(root: type, prefix: str, computed: Iterable[str] = ()) -> str:
    """Every field as a Markdown table row; ``computed`` keys' defaults depend on the machine
    and are described in their text instead."""
    skip = set(computed)
    rows = ["| field | flag, environment | default | what it does |",
            "| --- | --- | --- | --- |"]
    for s in settings(root, prefix):
        default = "(computed)" if s.key in skip else f"`{s.default!r}`"
        text = s.help.replace("|", "\\|")
        rows.append(f"| `{s.key}` | `{s.flag}`, `{s.env}` | {default} | {text} |")
    return "\n".join(rows) + "\n"


# -- the command line's errors ----------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage error is two short lines, not the whole usage (with
    one flag per config field, ``blockd serve``'s is a page): the error, with "did you mean
    --x?" for a mistyped flag or command (``difflib``; argparse's ``suggest_on_error`` exists
    only from Python 3.14), and where the help is. Exit status 2, as argparse's."""

    def error(self, message: str) -> typing.NoReturn:
        hint = suggestion(self, message)
        self.exit(2, f"{self.prog}: error: {message}{hint}\n"
                     f"{self.prog}: see '{self.prog} --help'\n")


def _options(parser: argparse.ArgumentParser) -> Iterator[str]:
    """Every option string of ``parser`` and of its subcommands' parsers."""
    for action in parser._actions:
        yield from action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _options(sub)


def _commands(parser: argparse.ArgumentParser) -> list[str]:
    return [name for action in parser._actions
            if isinstance(action, argparse._SubParsersAction) for name in action.choices]


def suggestion(parser: argparse.ArgumentParser, message: str) -> str:
    """``" (did you mean --pool-num-blocks?)"`` for the first unknown flag or invalid command
    of an argparse error message that has a close match, else ""."""
    words: list[str] = []
    candidates: list[str] = []
    if message.startswith("unrecognized arguments: "):
        words = [w.split("=", 1)[0] for w in message.split(": ", 1)[1].split()
                 if w.startswith("-")]
        candidates = list(_options(parser))
    elif "invalid choice: " in message:
        words = [message.split("invalid choice: ", 1)[1].split("'")[1]]
        candidates = _commands(parser)
    for word in words:
        close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
        if close:
            return f" (did you mean {close[0]}?)"
    return ""
