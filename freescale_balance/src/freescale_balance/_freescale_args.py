"""Argument types and the help layout shared by every ``freescale`` subcommand.

Shared by symbolic link, like ``_freescale_cli.py``, so that each component installs alone and
every subcommand refuses a bad value the same way: argparse prints one line naming the option
and exits with status 2, before any process starts.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

T = TypeVar("T")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` lists every option with its default after its meaning (an option whose
    default is ``None`` says in its own words what leaving it out does)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An argument parser that refuses a bad value in one line (no usage block) and shows
    every option's default in ``--help``; its subcommands' parsers are of the same kind."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _number(text: str, kind: type) -> int | float:
    try:
        return kind(text)
    except ValueError:
        noun = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An integer option of at least ``minimum``."""

    def parse(text: str) -> int:
        value = int(_number(text, int))
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def float_in(low: float, high: float | None = None, *, open_low: bool = False) -> Callable:
    """A number option in ``[low, high]`` (``(low, high]`` with ``open_low``)."""

    def check(value: float) -> float:
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {value:g}")
        too_low = value <= low if open_low else value < low
        if too_low or (high is not None and value > high):
            bracket = "(" if open_low else "["
            upper = f"{high:g}]" if high is not None else "inf)"
            raise argparse.ArgumentTypeError(f"must be in {bracket}{low:g}, {upper}, got {value:g}")
        return value

    def parse(text: str) -> float:
        return check(float(_number(text, float)))

    return parse


_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
_MAX_BYTES = 1 << 30


def byte_size(text: str) -> int:
    """A byte count such as ``4096``, ``4K``, ``64MiB`` or ``1G``, from 1 byte to 1 GiB."""
    number = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = _UNITS.get(number[-1:], 1)
    try:
        value = int(float(number[:-1] if scale > 1 else number) * scale)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size (bytes, or with K, M, G: 4K, 64M, 1G)"
        ) from None
    if not 1 <= value <= _MAX_BYTES:
        raise argparse.ArgumentTypeError(f"{text!r} must be from 1 byte to 1G")
    return value


def _list_of(item: Callable[[str], T]) -> Callable[[str], tuple[T, ...]]:
    """A comma-separated list of ``item`` values, at least one."""

    def parse(text: str) -> tuple[T, ...]:
        values = tuple(item(part.strip()) for part in text.split(",") if part.strip())
        if not values:
            raise argparse.ArgumentTypeError("needs at least one value")
        return values

    return parse


def int_list(minimum: int = 1) -> Callable[[str], tuple[int, ...]]:
    """A comma-separated list of integers, each at least ``minimum``, at least one."""
    return _list_of(int_at_least(minimum))


def float_list(low: float, high: float | None = None) -> Callable[[str], tuple[float, ...]]:
    """A comma-separated list of numbers in ``[low, high]``, at least one."""
    return _list_of(float_in(low, high))


def byte_size_list() -> Callable[[str], tuple[int, ...]]:
    """A comma-separated list of byte counts (``byte_size``), at least one."""
    return _list_of(byte_size)


def name_list(choices: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    """A comma-separated subset of ``choices``, at least one, each named once."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(part.strip() for part in text.split(","))
        if not any(names):
            raise argparse.ArgumentTypeError(f"needs at least one of {','.join(choices)}")
        if not all(names):
            raise argparse.ArgumentTypeError(f"an empty name in {text!r}")
        unknown = [name for name in names if name not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(unknown)}; choose from {','.join(choices)}"
            )
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise argparse.ArgumentTypeError(f"{', '.join(twice)} named more than once")
        return names

    return parse


def print_written(written: Sequence[Path], plot_extra: str) -> None:
    """Says which files a command wrote, and how to get the plot that needs matplotlib."""
    if len(written) == 1:
        print(f"matplotlib is not installed: no plot (pip install '{plot_extra}')")
    print("wrote " + ", ".join(str(path) for path in written))


def joined(values: Sequence[object]) -> str:
    """``values`` as the comma-separated text an option takes (a default shown in ``--help``)."""
    return ",".join(str(value) for value in values)
