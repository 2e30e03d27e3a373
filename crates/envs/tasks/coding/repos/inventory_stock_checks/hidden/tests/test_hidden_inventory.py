import unittest

from invtrack import InsufficientStockError, Inventory, InventoryError, Item, UnknownItemError


def make_inventory():
    inv = Inventory()
    inv.add_item(Item("bolt-m6", "M6 bolt", quantity=40, reorder_level=10))
    inv.add_item(Item("nut-m6", "M6 nut", quantity=5, reorder_level=8))
    inv.add_item(Item("washer", "Washer", quantity=12, reorder_level=12))
    return inv


class HiddenStockTests(unittest.TestCase):
    def test_failed_remove_leaves_stock_unchanged(self):
        inv = make_inventory()
        with self.assertRaises(InsufficientStockError):
            inv.remove("bolt-m6", 41)
        self.assertEqual(inv.get("bolt-m6").quantity, 40)
        self.assertEqual(inv.total_units(), 57)

    def test_error_carries_details(self):
        inv = make_inventory()
        with self.assertRaises(InsufficientStockError) as ctx:
            inv.remove("nut-m6", 9)
        err = ctx.exception
        self.assertEqual((err.sku, err.requested, err.available), ("nut-m6", 9, 5))
        self.assertIsInstance(err, InventoryError)

    def test_remove_exact_stock(self):
        inv = make_inventory()
        self.assertEqual(inv.remove("washer", 12), 0)
        with self.assertRaises(InsufficientStockError):
            inv.remove("washer", 1)

    def test_needs_reorder_boundaries(self):
        self.assertTrue(Item("a", "A", quantity=3, reorder_level=3).needs_reorder)
        self.assertTrue(Item("b", "B", quantity=2, reorder_level=3).needs_reorder)
        self.assertFalse(Item("c", "C", quantity=4, reorder_level=3).needs_reorder)

    def test_report_after_removal(self):
        inv = make_inventory()
        inv.remove("bolt-m6", 30)
        self.assertEqual(inv.reorder_report(), ["bolt-m6", "nut-m6", "washer"])


class HiddenRegressionTests(unittest.TestCase):
    def test_invalid_quantities(self):
        inv = make_inventory()
        with self.assertRaises(ValueError):
            inv.remove("bolt-m6", 0)
        with self.assertRaises(ValueError):
            inv.restock("bolt-m6", -1)
        with self.assertRaises(ValueError):
            Item("x", "X", quantity=-1)

    def test_duplicate_and_unknown(self):
        inv = make_inventory()
        with self.assertRaises(InventoryError):
            inv.add_item(Item("washer", "Other washer"))
        with self.assertRaises(UnknownItemError):
            inv.remove("missing", 1)
        with self.assertRaises(KeyError):
            inv.restock("missing", 1)

    def test_total_units_and_restock(self):
        inv = make_inventory()
        inv.restock("washer", 8)
        self.assertEqual(inv.total_units(), 65)
        self.assertEqual(inv.reorder_report(), ["nut-m6"])

    def test_empty_inventory(self):
        inv = Inventory()
        self.assertEqual(len(inv), 0)
        self.assertEqual(inv.total_units(), 0)
        self.assertEqual(inv.reorder_report(), [])


if __name__ == "__main__":
    unittest.main()
