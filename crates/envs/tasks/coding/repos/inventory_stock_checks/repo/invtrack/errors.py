"""Exceptions raised by invtrack."""


class InventoryError(Exception):
    """Base class for inventory problems."""


class UnknownItemError(InventoryError, KeyError):
    """Raised when a SKU is not in the inventory."""

    def __init__(self, sku):
        super().__init__(sku)
        self.sku = sku

    def __str__(self):
        return f"unknown item: {self.sku}"


class InsufficientStockError(InventoryError):
    """Raised when more units are requested than are in stock."""

    def __init__(self, sku, requested, available):
        super().__init__(sku, requested, available)
        self.sku = sku
        self.requested = requested
        self.available = available

    def __str__(self):
        return (f"cannot remove {self.requested} x {self.sku}: "
                f"only {self.available} in stock")
