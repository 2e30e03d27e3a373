import unittest

from minicfg import Config, MissingOptionError

TEXT = """
home = /srv/app
debug = yes

[server]
port = 8080
logs = ${home}/logs
"""


class ConfigTests(unittest.TestCase):
    def setUp(self):
        self.cfg = Config.from_string(TEXT)

    def test_get_falls_back_to_default(self):
        self.assertEqual(self.cfg.get("server", "home"), "/srv/app")

    def test_missing_option(self):
        with self.assertRaises(MissingOptionError):
            self.cfg.get("server", "nope")
        self.assertEqual(self.cfg.get("server", "nope", fallback="x"), "x")

    def test_typed_getters(self):
        self.assertEqual(self.cfg.getint("server", "port"), 8080)
        self.assertIs(self.cfg.getbool("server", "debug"), True)

    def test_interpolation(self):
        self.assertEqual(self.cfg.get("server", "logs"), "/srv/app/logs")


if __name__ == "__main__":
    unittest.main()
