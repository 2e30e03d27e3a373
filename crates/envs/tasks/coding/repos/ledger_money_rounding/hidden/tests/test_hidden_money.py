import unittest

from ledger import CurrencyMismatchError, Money, format_money


class HiddenParseTests(unittest.TestCase):
    def test_parse_many_amounts_exactly(self):
        cases = {
            "19.99": 1999, "0.29": 29, "1.15": 115, "4.35": 435, "0.07": 7,
            "-0.29": -29, "5": 500, "5.5": 550, "1,234.5": 123450,
            " 1,000,000.01 ": 100000001, "-19.99": -1999, "0": 0,
        }
        for text, cents in cases.items():
            self.assertEqual(Money.parse(text).cents, cents, text)

    def test_every_cent_value_round_trips(self):
        for cents in range(0, 10000, 7):
            text = f"{cents // 100}.{cents % 100:02d}"
            self.assertEqual(Money.parse(text).cents, cents, text)

    def test_parse_keeps_currency(self):
        self.assertEqual(Money.parse("2.50", "EUR"), Money(250, "EUR"))

    def test_parse_invalid(self):
        for text in ["", "1.234", "1.", ".5", "--1", "1e3", "12.3.4", "abc"]:
            with self.assertRaises(ValueError, msg=text):
                Money.parse(text)


class HiddenAllocateTests(unittest.TestCase):
    def cents(self, money, ratios):
        return [m.cents for m in money.allocate(ratios)]

    def test_leftover_goes_to_first_parts(self):
        self.assertEqual(self.cents(Money(5), [70, 30]), [4, 1])
        self.assertEqual(self.cents(Money(11), [1, 1, 1, 1]), [3, 3, 3, 2])
        self.assertEqual(self.cents(Money(100), [1, 2, 3]), [17, 33, 50])

    def test_parts_always_sum_to_total(self):
        for total in (1, 2, 99, 1001, 12345, 99999):
            for ratios in ([1], [1, 1], [3, 7], [1, 1, 1, 1, 1, 1, 1], [5, 0, 2]):
                parts = Money(total).allocate(ratios)
                self.assertEqual(sum(p.cents for p in parts), total, (total, ratios))

    def test_negative_amount(self):
        self.assertEqual(self.cents(Money(-100), [1, 1, 1]), [-34, -33, -33])
        self.assertEqual(sum(self.cents(Money(-10001), [2, 3])), -10001)

    def test_zero_ratio_gets_nothing_and_currency_kept(self):
        parts = Money(1000, "EUR").allocate([0, 1])
        self.assertEqual(parts, [Money(0, "EUR"), Money(1000, "EUR")])

    def test_invalid_ratios(self):
        for ratios in ([], [0, 0], [1, -1]):
            with self.assertRaises(ValueError, msg=repr(ratios)):
                Money(100).allocate(ratios)


class HiddenRegressionTests(unittest.TestCase):
    def test_arithmetic(self):
        self.assertEqual(Money(500) - Money(725), Money(-225))
        self.assertEqual(-Money(5), Money(-5))
        self.assertEqual(Money(250) * 3, Money(750))
        self.assertEqual(2 * Money(250), Money(500))
        with self.assertRaises(CurrencyMismatchError):
            Money(1, "GBP") - Money(1, "EUR")

    def test_format(self):
        self.assertEqual(format_money(Money(-500)), "-$5.00")
        self.assertEqual(format_money(Money(7)), "$0.07")
        self.assertEqual(format_money(Money(123456789, "EUR")), "1,234,567.89 EUR")


if __name__ == "__main__":
    unittest.main()
