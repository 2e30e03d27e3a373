"""The inventory itself."""

from .errors import InsufficientStockError, InventoryError, UnknownItemError


class Inventory:
    """A collection of items keyed by SKU."""

    def __init__(self):
        self._items = {}

    def __len__(self):
        return len(self._items)

    def __contains__(self, sku):
        return sku in self._items

    def add_item(self, item):
        """Add a new item; adding a SKU twice is an error."""
        if item.sku in self._items:
            raise InventoryError(f"duplicate sku: {item.sku}")
        self._items[item.sku] = item

    def get(self, sku):
        """Return the item for ``sku`` or raise UnknownItemError."""
        try:
            return self._items[sku]
        except KeyError:
            raise UnknownItemError(sku) from None

    def restock(self, sku, qty):
        """Add ``qty`` (> 0) units and return the new quantity."""
        if qty <= 0:
            raise ValueError("qty must be positive")
        item = self.get(sku)
        item.quantity += qty
        return item.quantity

    def remove(self, sku, qty):
        """Take ``qty`` (> 0) units out of stock and return the new quantity.

        Raises InsufficientStockError (leaving the stock untouched) when fewer
        than ``qty`` units are available.
        """
        if qty <= 0:
            raise ValueError("qty must be positive")
        item = self.get(sku)
        item.quantity -= qty
        return item.quantity

    def total_units(self):
        """Total number of units across all items."""
        return sum(item.quantity for item in self._items.values())

    def reorder_report(self):
        """Sorted SKUs of every item at or below its reorder level."""
        return sorted(sku for sku, item in self._items.items() if item.needs_reorder)
