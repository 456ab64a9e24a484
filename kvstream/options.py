"""Command-line flags generated from a settings class, so a setting is declared once.

Each field of a pydantic-settings class becomes ``--field-name`` (help: the field's description, its default
and its ``KVSTREAM_*`` variable). Flags not given are left out, so the settings class applies its precedence:
flag, then environment variable, then default (docs/configuration.md).
"""

from __future__ import annotations

import argparse
import typing
from pathlib import Path

from pydantic import ValidationError
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings


def flag(name: str) -> str:
    """``--field-name`` of a settings field."""
    return "--" + name.replace("_", "-")


def env_variable(settings_class: type[BaseSettings], name: str) -> str:
    """The environment variable of a settings field (the class's prefix + the field name, upper case)."""
    return f"{settings_class.model_config.get('env_prefix', '')}{name}".upper()


def add_settings_arguments(parser: argparse.ArgumentParser, settings_class: type[BaseSettings],
                           exclude: tuple[str, ...] = ()) -> None:
    """Add one flag per field of ``settings_class`` (but ``exclude``) to ``parser``, defaulting to "not given"."""
    for name, info in settings_class.model_fields.items():
        if name in exclude:
            continue
        choices = typing.get_args(info.annotation) if typing.get_origin(info.annotation) is typing.Literal else None
        default = info.default
        shown = "required" if default is PydanticUndefined else "none" if default in ("", None, []) else default
        help_text = f"{info.description} (default: {shown}; env {env_variable(settings_class, name)})"
        kwargs: dict = {"default": argparse.SUPPRESS, "help": help_text.replace("%", "%%")}
        if info.annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(info.annotation) is list:
            kwargs.update(action="append", metavar=name.upper())
        else:
            kwargs["metavar"] = "|".join(choices) if choices else name.upper()
            kwargs["type"] = Path if info.annotation is Path else str
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        parser.add_argument(flag(name), *extra.get("flag_aliases", ()), dest=name, **kwargs)


def settings_from_args(settings_class: type[BaseSettings], args: argparse.Namespace):
    """The settings of a command: its flags given in ``args`` over ``KVSTREAM_*`` variables over defaults.

    Raises:
        ValueError: a value is refused; the message names the flag and its variable.
    """
    given = {name: getattr(args, name) for name in settings_class.model_fields if hasattr(args, name)}
    try:
        return settings_class(**given)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            if not error["loc"]:  # a rule across settings: its message names them
                problems.append(error["msg"].removeprefix("Value error, "))
                continue
            name = str(error["loc"][0])
            if error["type"] == "missing":  # given neither way: name both
                problems.append(f"{flag(name)} (or {env_variable(settings_class, name)}) is required")
                continue
            source = flag(name) if name in given else env_variable(settings_class, name)
            problems.append(f"{source}: {error['msg']}")
        raise ValueError("; ".join(problems)) from None


def settings_to_argv(settings: BaseSettings) -> list[str]:
    """The flags that give every field of ``settings`` its value (to start a child process with them)."""
    argv: list[str] = []
    for name in type(settings).model_fields:
        value = getattr(settings, name)
        if isinstance(value, bool):
            argv.append(flag(name) if value else "--no-" + flag(name)[2:])
        elif isinstance(value, list):
            argv += [f"{flag(name)}={item}" for item in value]
        elif value is not None:
            argv.append(f"{flag(name)}={value}")  # one word: a value starting with "-" is no flag
    return argv


def documented_default(settings_class: type[BaseSettings], name: str) -> str:
    """A field's default as docs/configuration.md writes it (``""`` for an empty string)."""
    default = settings_class.model_fields[name].default
    if default is PydanticUndefined:
        return "required"
    return '""' if default == "" else "none" if default is None or default == [] else str(default)


def settings_table(settings_class: type[BaseSettings]) -> list[tuple[str, str, str, str, str]]:
    """Rows ``(setting, flag, variable, default, meaning)`` of a settings class, as docs/configuration.md
    lists them."""
    return [(name, flag(name), env_variable(settings_class, name), documented_default(settings_class, name),
             info.description or "") for name, info in settings_class.model_fields.items()]


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An argparse type: a whole number of at least 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a number above 0 (seconds, rates)."""
    value = float(text)
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def interrupt_on_sigterm() -> None:
    """Make SIGTERM stop the command as Ctrl-C does (KeyboardInterrupt), so it stops what it started."""
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def run_command(prog: str, command, *args) -> int:
    """``command(*args)``'s exit code; Ctrl-C is 130, and a RuntimeError, TimeoutError or ValueError is printed
    as ``<prog>: error: <message>`` with exit code 1 (no traceback: these are the errors users meet)."""
    import sys

    try:
        return command(*args)
    except KeyboardInterrupt:
        return 130
    except (RuntimeError, TimeoutError, ValueError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
