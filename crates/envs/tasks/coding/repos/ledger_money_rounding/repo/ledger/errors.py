"""Exceptions raised by ledger."""


class CurrencyMismatchError(ValueError):
    """Raised when combining amounts in different currencies."""

    def __init__(self, left, right):
        super().__init__(f"currency mismatch: {left} vs {right}")
        self.left = left
        self.right = right
