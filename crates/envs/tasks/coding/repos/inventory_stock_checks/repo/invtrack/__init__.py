"""A tiny in-memory inventory tracker."""

from .errors import InsufficientStockError, InventoryError, UnknownItemError
from .inventory import Inventory
from .item import Item

__all__ = [
    "Inventory",
    "InventoryError",
    "InsufficientStockError",
    "Item",
    "UnknownItemError",
]
