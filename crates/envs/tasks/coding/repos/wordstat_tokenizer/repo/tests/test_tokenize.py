import unittest

from wordstat import tokenize


class TokenizeTests(unittest.TestCase):
    def test_simple_sentence(self):
        self.assertEqual(tokenize("The quick brown Fox!"), ["the", "quick", "brown", "fox"])

    def test_digits(self):
        self.assertEqual(tokenize("route 66, 2024 edition"), ["route", "66", "2024", "edition"])

    def test_contractions_and_hyphens(self):
        self.assertEqual(
            tokenize("Don't panic, it's a well-known fact."),
            ["don't", "panic", "it's", "a", "well-known", "fact"],
        )


if __name__ == "__main__":
    unittest.main()
