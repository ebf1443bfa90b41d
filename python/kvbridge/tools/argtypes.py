"""argparse ``type=`` checks shared by the subcommands: a bad value is a usage error naming the
flag (exit 2), never a traceback from deep inside the component it would have reached."""

from __future__ import annotations

import argparse
import math
from typing import Callable

__all__ = ["non_negative", "non_negative_int", "positive", "positive_int"]


def _int(text: str, what: str, low: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return v


def _float(text: str, what: str, ok: Callable[[float], bool]) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if not math.isfinite(v) or not ok(v):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return v


def positive_int(text: str) -> int:
    return _int(text, "a positive integer", 1)


def non_negative_int(text: str) -> int:
    return _int(text, "an integer >= 0", 0)


def positive(text: str) -> float:
    return _float(text, "a finite number > 0", lambda v: v > 0)


def non_negative(text: str) -> float:
    return _float(text, "a finite number >= 0", lambda v: v >= 0)
