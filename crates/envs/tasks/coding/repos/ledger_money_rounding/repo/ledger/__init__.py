"""Exact money arithmetic in integer cents."""

from .errors import CurrencyMismatchError
from .format import format_money
from .money import Money

__all__ = ["CurrencyMismatchError", "Money", "format_money"]
