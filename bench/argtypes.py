"""Argument types of the benchmark's command lines, shared by its subcommands.

Each raises ``argparse.ArgumentTypeError``, which argparse reports as
"argument --opt: <message>" and exit status 2.
"""

from __future__ import annotations

import argparse
import math

from .models import ModelGeometry, dtype_bytes, resolve_model


def model_arg(text: str) -> ModelGeometry:
    """A preset name or a custom geometry (models.resolve_model)."""
    try:
        return resolve_model(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def dtype_arg(text: str) -> str:
    """A KV-cache dtype name (fp8, fp16, bf16, fp32), lower-cased."""
    try:
        dtype_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text.strip().lower()


def int_at_least(text: str, minimum: int) -> int:
    """An integer of at least ``minimum``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{value} must be at least {minimum}")
    return value


def positive_int(text: str) -> int:
    """An integer of at least 1."""
    return int_at_least(text, 1)


def nonneg_int(text: str) -> int:
    """An integer of at least 0."""
    return int_at_least(text, 0)


def number(text: str, allow_zero: bool) -> float:
    """A finite number above 0 (at least 0 with ``allow_zero``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be finite")
    if value < 0 or (value == 0 and not allow_zero):
        raise argparse.ArgumentTypeError(f"{value:g} must be {'at least 0' if allow_zero else 'positive'}")
    return value


def positive_float(text: str) -> float:
    """A finite number above 0."""
    return number(text, allow_zero=False)


def nonneg_float(text: str) -> float:
    """A finite number of at least 0."""
    return number(text, allow_zero=True)
