import unittest

from minicfg import Config, ParseError, parse


class HiddenParserTests(unittest.TestCase):
    def test_split_only_at_first_equals(self):
        data = parse("expr = a = b == c\nempty =\nquery=x=1&y=2\n")
        self.assertEqual(data["DEFAULT"], {"expr": "a = b == c", "empty": "", "query": "x=1&y=2"})

    def test_repeated_section_and_option(self):
        data = parse("[a]\nx = 1\n[b]\ny = 2\n[a]\nx = 3\nz = 4\n")
        self.assertEqual(data["a"], {"x": "3", "z": "4"})
        self.assertEqual(data["b"], {"y": "2"})

    def test_errors(self):
        with self.assertRaises(ParseError):
            parse("[ ]\n")
        with self.assertRaises(ParseError):
            parse(" = value\n")

    def test_sections_listing(self):
        cfg = Config.from_string("a = 1\n[zeta]\n[alpha]\nb = 2\n")
        self.assertEqual(cfg.sections(), ["alpha", "zeta"])
        self.assertTrue(cfg.has_option("zeta", "A"))
        self.assertFalse(cfg.has_option("nosuch", "a"))


if __name__ == "__main__":
    unittest.main()
