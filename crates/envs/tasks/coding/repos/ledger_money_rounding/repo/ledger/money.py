"""The Money value type."""

import re
from dataclasses import dataclass

from .errors import CurrencyMismatchError

_AMOUNT = re.compile(r"-?\d+(\.\d{1,2})?")


@dataclass(frozen=True)
class Money:
    """An amount of money stored as an integer number of cents."""

    cents: int
    currency: str = "USD"

    @classmethod
    def parse(cls, text, currency="USD"):
        """Parse a decimal amount such as "12.34", "-0.5", "1,234.56" or "7".

        Thousands separators (",") are ignored; at most two decimals are
        allowed. Raises ValueError for anything else.
        """
        cleaned = text.strip().replace(",", "")
        if not _AMOUNT.fullmatch(cleaned):
            raise ValueError(f"not a money amount: {text!r}")
        return cls(int(float(cleaned) * 100), currency)

    def _check(self, other):
        if not isinstance(other, Money):
            return NotImplemented
        if other.currency != self.currency:
            raise CurrencyMismatchError(self.currency, other.currency)
        return None

    def __add__(self, other):
        bad = self._check(other)
        if bad is NotImplemented:
            return NotImplemented
        return Money(self.cents + other.cents, self.currency)

    def __sub__(self, other):
        bad = self._check(other)
        if bad is NotImplemented:
            return NotImplemented
        return Money(self.cents - other.cents, self.currency)

    def __neg__(self):
        return Money(-self.cents, self.currency)

    def __mul__(self, factor):
        if not isinstance(factor, int) or isinstance(factor, bool):
            return NotImplemented
        return Money(self.cents * factor, self.currency)

    __rmul__ = __mul__

    def allocate(self, ratios):
        """Split this amount into parts proportional to ``ratios``.

        The parts always add up exactly to this amount: every part first gets
        its proportional share rounded down, then the leftover cents are
        handed out one at a time to the parts in order, starting with the
        first. A negative amount is split like its absolute value, then each
        part is negated. ``ratios`` must be non-empty, non-negative integers
        with a positive sum (ValueError otherwise).
        """
        ratios = list(ratios)
        if not ratios or any(r < 0 for r in ratios) or sum(ratios) <= 0:
            raise ValueError("ratios must be non-negative with a positive sum")
        total = sum(ratios)
        return [Money(self.cents * r // total, self.currency) for r in ratios]
