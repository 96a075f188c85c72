"""Typed settings: each component reads one frozen dataclass built once from the parsed arguments.

A component declares every value it takes from the command line as a field made with `option(dest, ...)`
on a frozen dataclass derived from `Settings`: its `from_args(args)` gets them with `options_from_args` and its
`__post_init__` calls `check_options(self)`, which enforces the bounds and choices the fields declare with errors that
name the flag ("--micro-batch-size must be >= 1, got 0"). An attribute that `args` lacks or that holds
None takes the field's default, so tests and tools may pass a namespace holding only a few attributes;
the defaults equal the flags' defaults (tests/test_args_attributes.py checks it).

`tests/test_args_attributes.py` reads the `dest` of every `option(...)` call as an attribute read from the
run's arguments: each must be a destination of the parser or an attribute the framework sets.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import field, fields
from typing import Any

__all__ = ["Settings", "check_options", "flag", "option", "options_from_args"]


def option(
    dest: str,
    default: Any = None,
    *,
    convert: Callable[[Any], Any] | None = None,
    minimum: float | None = None,
    above: float | None = None,
    choices: Collection[str] | None = None,
) -> Any:
    """A settings field read from `args.<dest>`: converted with `convert`, checked against `minimum` (>=),
    `above` (>) and `choices` when not None."""
    metadata = {"dest": dest, "convert": convert, "minimum": minimum, "above": above, "choices": choices}
    return field(default=default, metadata=metadata)


def flag(dest: str) -> str:
    """The command-line spelling of destination `dest`: `micro_batch_size` -> `--micro-batch-size`."""
    return "--" + dest.replace("_", "-")


def options_from_args(cls: Any, args: Any) -> dict[str, Any]:
    """`{field name: value}` of `cls`'s `option` fields that `args` sets (attributes it lacks or holds as None
    are left out, so they take the field's default)."""
    values: dict[str, Any] = {}
    for item in fields(cls):
        dest = item.metadata.get("dest")
        value = None if dest is None else getattr(args, dest, None)
        if value is None:
            continue
        convert = item.metadata["convert"]
        if convert is not None:
            try:
                value = convert(value)
            except (TypeError, ValueError) as exc:
                if flag(dest) in str(exc):  # a converter of the option's own, whose message names the flag
                    raise ValueError(str(exc)) from exc
                raise ValueError(f"{flag(dest)} must be {convert.__name__}, got {value!r}") from exc
        values[item.name] = value
    return values


def check_options(settings: Any) -> None:
    """Raise ValueError, naming the flag, for the first `option` field of `settings` outside its declared bounds."""
    for item in fields(settings):
        value = getattr(settings, item.name)
        dest = item.metadata.get("dest")
        if dest is None or value is None:
            continue
        minimum, above, choices = item.metadata["minimum"], item.metadata["above"], item.metadata["choices"]
        if minimum is not None and value < minimum:
            raise ValueError(f"{flag(dest)} must be >= {minimum}, got {value}")
        if above is not None and value <= above:
            raise ValueError(f"{flag(dest)} must be > {above}, got {value}")
        if choices is not None and value not in choices:
            raise ValueError(f"{flag(dest)} must be one of {', '.join(choices)}, got {value!r}")


class Settings:
    """Base of a settings dataclass: `from_args` reads its `option` fields, `__post_init__` checks them.

    A subclass that derives a default from another field overrides `from_args`; one with checks beyond bounds and
    choices extends `__post_init__` (calling this one first).
    """

    def __post_init__(self) -> None:
        check_options(self)

    @classmethod
    def from_args(cls, args: Any) -> Any:
        """The settings of `args`; ValueError naming the flag when one is out of range."""
        return cls(**options_from_args(cls, args))
