import unittest

from minicfg import Config, InterpolationError, MissingOptionError

TEXT = """
root = /opt
user = svc

[paths]
base = ${root}/app
data = ${base}/data
cache = ${data}/cache
price = $$5 and $x and ${dollar}
dollar = $$

[server]
Host = appserver01
port = 80${suffix}
suffix = 80
endpoint = ${host}:${port} serving ${paths:data}
owner = ${USER}
debug = ${flags:verbose}

[flags]
verbose = on
"""


class HiddenInterpolationTests(unittest.TestCase):
    def setUp(self):
        self.cfg = Config.from_string(TEXT)

    def test_recursive_references(self):
        self.assertEqual(self.cfg.get("paths", "cache"), "/opt/app/data/cache")

    def test_cross_section_reference_resolves_in_its_own_section(self):
        self.assertEqual(self.cfg.get("server", "endpoint"), "appserver01:8080 serving /opt/app/data")

    def test_default_and_case_insensitive_names(self):
        self.assertEqual(self.cfg.get("server", "owner"), "svc")
        self.assertEqual(self.cfg.get("DEFAULT", "root"), "/opt")

    def test_dollar_escapes(self):
        self.assertEqual(self.cfg.get("paths", "price"), "$5 and $x and $")

    def test_raw(self):
        self.assertEqual(self.cfg.get("paths", "data", raw=True), "${base}/data")

    def test_typed_getters_interpolate(self):
        self.assertEqual(self.cfg.getint("server", "port"), 8080)
        self.assertIs(self.cfg.getbool("server", "debug"), True)

    def test_cycles(self):
        cfg = Config.from_string("[a]\nx = ${y}\ny = ${b:z}\n[b]\nz = ${a:x}\nself = <${self}>\n")
        with self.assertRaises(InterpolationError):
            cfg.get("a", "x")
        with self.assertRaises(InterpolationError):
            cfg.get("b", "self")

    def test_same_reference_twice_is_not_a_cycle(self):
        cfg = Config.from_string("[a]\nw = hi\nx = ${w}-${w}\ny = ${x}|${x}\n")
        self.assertEqual(cfg.get("a", "y"), "hi-hi|hi-hi")

    def test_bad_references(self):
        cfg = Config.from_string("[a]\nmissing = ${nope}\nsection = ${zzz:x}\nopen = ${abc\n")
        for option in ("missing", "section", "open"):
            with self.assertRaises(InterpolationError, msg=option):
                cfg.get("a", option)
            with self.assertRaises(InterpolationError, msg=option):
                cfg.get("a", option, fallback="ignored")

    def test_plain_values_and_missing_options_unchanged(self):
        cfg = Config.from_string("[a]\nplain = 100% $ sure\n")
        self.assertEqual(cfg.get("a", "plain"), "100% $ sure")
        self.assertEqual(cfg.get("a", "other", fallback=None), None)
        with self.assertRaises(MissingOptionError):
            cfg.get("a", "other")


if __name__ == "__main__":
    unittest.main()
