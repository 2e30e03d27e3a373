import unittest

from invtrack import InsufficientStockError, Inventory, Item, UnknownItemError


def make_inventory():
    inv = Inventory()
    inv.add_item(Item("bolt-m6", "M6 bolt", quantity=40, reorder_level=10))
    inv.add_item(Item("nut-m6", "M6 nut", quantity=5, reorder_level=8))
    inv.add_item(Item("washer", "Washer", quantity=12, reorder_level=12))
    return inv


class InventoryTests(unittest.TestCase):
    def test_get_and_contains(self):
        inv = make_inventory()
        self.assertIn("bolt-m6", inv)
        self.assertEqual(inv.get("nut-m6").name, "M6 nut")
        self.assertEqual(len(inv), 3)

    def test_unknown_sku(self):
        with self.assertRaises(UnknownItemError):
            make_inventory().get("screw")

    def test_restock(self):
        inv = make_inventory()
        self.assertEqual(inv.restock("nut-m6", 10), 15)

    def test_remove(self):
        inv = make_inventory()
        self.assertEqual(inv.remove("bolt-m6", 15), 25)

    def test_remove_more_than_available(self):
        inv = make_inventory()
        with self.assertRaises(InsufficientStockError):
            inv.remove("nut-m6", 6)

    def test_reorder_report_includes_items_at_level(self):
        self.assertEqual(make_inventory().reorder_report(), ["nut-m6", "washer"])


if __name__ == "__main__":
    unittest.main()
