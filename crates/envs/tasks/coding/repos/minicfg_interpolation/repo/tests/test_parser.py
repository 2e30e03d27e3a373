import unittest

from minicfg import ParseError, parse

SAMPLE = """
# global settings
name = demo

[server]
Host = appserver01
port = 8080
; comment
[paths]
home = /srv/demo
"""


class ParserTests(unittest.TestCase):
    def test_sections_and_default(self):
        data = parse(SAMPLE)
        self.assertEqual(data["DEFAULT"], {"name": "demo"})
        self.assertEqual(data["server"], {"host": "appserver01", "port": "8080"})
        self.assertEqual(data["paths"], {"home": "/srv/demo"})

    def test_bad_line_reports_line_number(self):
        with self.assertRaises(ParseError) as ctx:
            parse("[a]\nx = 1\noops\n")
        self.assertEqual(ctx.exception.lineno, 3)

    def test_value_containing_equals(self):
        data = parse("[db]\nurl = postgres://host/app?sslmode=require\n")
        self.assertEqual(data["db"]["url"], "postgres://host/app?sslmode=require")


if __name__ == "__main__":
    unittest.main()
