import unittest

from ledger import CurrencyMismatchError, Money, format_money


class ParseTests(unittest.TestCase):
    def test_parse_simple(self):
        self.assertEqual(Money.parse("12.50"), Money(1250))

    def test_parse_is_exact(self):
        self.assertEqual(Money.parse("0.29").cents, 29)

    def test_parse_rejects_garbage(self):
        with self.assertRaises(ValueError):
            Money.parse("twelve")


class ArithmeticTests(unittest.TestCase):
    def test_add(self):
        self.assertEqual(Money(150) + Money(275), Money(425))

    def test_add_currency_mismatch(self):
        with self.assertRaises(CurrencyMismatchError):
            Money(1, "USD") + Money(1, "EUR")


class AllocateTests(unittest.TestCase):
    def test_allocate_even(self):
        self.assertEqual([m.cents for m in Money(900).allocate([1, 1, 1])], [300, 300, 300])

    def test_allocate_keeps_every_cent(self):
        parts = Money(10000).allocate([1, 1, 1])
        self.assertEqual([m.cents for m in parts], [3334, 3333, 3333])


class FormatTests(unittest.TestCase):
    def test_format(self):
        self.assertEqual(format_money(Money(123456)), "$1,234.56")


if __name__ == "__main__":
    unittest.main()
