"""Stock-keeping items."""

from dataclasses import dataclass


@dataclass
class Item:
    """One stock-keeping unit.

    ``quantity`` is the number of units on hand; ``reorder_level`` is the
    threshold at (or below) which the item should be reordered.
    """

    sku: str
    name: str
    quantity: int = 0
    reorder_level: int = 0

    def __post_init__(self):
        if not self.sku:
            raise ValueError("sku must not be empty")
        if self.quantity < 0:
            raise ValueError("quantity must not be negative")
        if self.reorder_level < 0:
            raise ValueError("reorder_level must not be negative")

    @property
    def needs_reorder(self):
        """True when the quantity is at or below the reorder level."""
        return self.quantity < self.reorder_level
