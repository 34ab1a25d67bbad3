"""``better-compute serve --config FILE``: serve's flags from a TOML file.

Every flag of ``serve`` has its key, the flag's long name without ``--`` exactly as
written (``api-listen``, ``secret-file``); the table is built from the argparse parser
itself, so a flag added to ``serve`` gets its key with it. A flag given on the command
line overrides the file's key (a repeatable flag's command-line values replace the
file's list). Values: a string, a number, ``true``/``false`` for a switch, a list of
strings for a repeatable flag; each is checked by the flag's own parser.

The file may name the secret's file, the TLS bundle and the database (whose URL may
hold a password), so it is refused unless it is a regular file owned by root or the
user running serve and writable by nobody else; a database URL with a password (in
its authority, or a ``password``/``sslpassword`` query parameter) in a file other users
can read is refused too.
"""

from __future__ import annotations

import argparse
import os
import stat
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import parse_qs, urlsplit

from bcd import fs

MAX_CONFIG_BYTES = 64 * 1024
_NOT_KEYS = {"help", "config"}


class ServeConfigError(Exception):
    """A config file that cannot be used: a usage error (exit 2)."""


def _subparser(top: argparse.ArgumentParser, *path: str) -> argparse.ArgumentParser:
    parser = top
    for name in path:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction) and name in action.choices:
                parser = action.choices[name]
                break
        else:
            raise KeyError(name)
    return parser


def keys(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The config keys of a (sub)parser's flags: long name without ``--``."""
    out: dict[str, argparse.Action] = {}
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if longs and longs[0][2:] not in _NOT_KEYS:
            out[longs[0][2:]] = action
    return out


def _tokens(path: Path, key: str, action: argparse.Action, value: Any) -> list[str]:
    flag = f"--{key}"
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise ServeConfigError(f'{path}: key "{key}" is a switch: true or false')
        return [flag] if value else []
    if isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
    elif isinstance(value, list):
        raise ServeConfigError(f'{path}: key "{key}" takes one value, not a list')
    else:
        items = [value]
    out: list[str] = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, str | int | float):
            raise ServeConfigError(f'{path}: key "{key}": expected a string or a number')
        out += [flag, str(item)]
    return out


def _judge(path: Path, seen: list[int]) -> Any:
    """The config file's judge; it appends the opened file's mode to ``seen``."""

    def judge(st: os.stat_result) -> None:
        seen.append(stat.S_IMODE(st.st_mode))
        problem = fs.writers_problem(path, st, "it says which secret, keys and database serve uses")
        if problem is not None:
            raise ServeConfigError(problem)

    return judge


def read(path: Path) -> tuple[dict[str, Any], int]:
    """The file's table and its mode, judged (owner, writers, size, kind)."""
    seen: list[int] = []  # the mode of the file opened, not of a second stat's
    try:
        data = fs.read_regular_file(path, MAX_CONFIG_BYTES, judge=_judge(path, seen))
        mode = seen[0]
    except FileNotFoundError:
        raise ServeConfigError(f"--config {path}: no such file") from None
    except IsADirectoryError:
        raise ServeConfigError(f"--config {path}: is a directory") from None
    except fs.NotRegularFile as exc:
        raise ServeConfigError(f"--config {path}: is {exc.kind}, not a regular file") from None
    except fs.FileTooLarge:
        raise ServeConfigError(f"--config {path}: larger than {MAX_CONFIG_BYTES} bytes") from None
    except OSError as exc:
        raise ServeConfigError(f"--config {path}: cannot be read: {exc.strerror}") from None
    try:
        return tomllib.loads(data.decode("utf-8")), mode
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError) as exc:
        raise ServeConfigError(f"{path}: not valid TOML: {exc}") from None


def _has_password(path: Path, url: str) -> bool:
    """Whether the database URL holds a password: in its authority, or as a
    ``password``/``sslpassword`` query parameter. A URL that does not parse is a usage
    error naming the file and the key (never the value)."""
    try:
        parts = urlsplit(url)
        query = parse_qs(parts.query, keep_blank_values=True)
        return bool(parts.password) or any(query.get(k) for k in ("password", "sslpassword"))
    except ValueError:
        raise ServeConfigError(f'{path}: key "db": not a valid database URL') from None


def _given(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The dests the command line set itself (every default suppressed for the parse)."""
    saved = [(a, a.default) for a in parser._actions]
    try:
        for action, _default in saved:
            action.default = argparse.SUPPRESS
        return set(vars(parser.parse_args(argv)))
    finally:
        for action, default in saved:
            action.default = default


def apply(
    top: argparse.ArgumentParser, argv: Sequence[str], args: argparse.Namespace, path: Path
) -> None:
    """Fill ``args`` (``serve``'s parsed command line) from the config file at ``path``
    for every flag the command line did not give."""
    serve = _subparser(top, "serve")
    table, mode = read(path)
    known = keys(serve)
    tokens: list[str] = []
    for key, value in table.items():
        action = known.get(key)
        if action is None:
            hint = key.replace("_", "-")
            also = f' (the keys are the flags\' names: "{hint}")' if hint in known else ""
            raise ServeConfigError(f'{path}: unknown key "{key}"{also}')
        tokens += _tokens(path, key, action, value)
    url = table.get("db")
    if isinstance(url, str) and _has_password(path, url) and mode & 0o044:
        raise ServeConfigError(
            f"{path} holds a database password and other users can read it (mode {mode:04o}): "
            f"chmod go-r {path}"
        )

    def error(message: str) -> NoReturn:
        raise ServeConfigError(f"{path}: {message}")

    serve.error = error  # type: ignore[method-assign]
    from_file = serve.parse_args(tokens)
    given = _given(serve, list(argv)[list(argv).index("serve") + 1 :])
    for key in table:
        dest = known[key].dest
        if dest not in given:
            setattr(args, dest, getattr(from_file, dest))
