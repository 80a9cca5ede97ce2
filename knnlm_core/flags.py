"""Types of command-line flags shared by `knnlm-index` and `knnlm-eval`."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """A command-line flag's type: a count or size, where 0 would silently mean "the default" or nothing."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {value}")
    return value
