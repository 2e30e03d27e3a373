import unittest

from wordstat import average_word_length, lexical_diversity, tokenize, top_words, word_counts


class HiddenTokenizeTests(unittest.TestCase):
    def test_leading_and_trailing_quotes(self):
        self.assertEqual(tokenize("'Quoted' words' end"), ["quoted", "words", "end"])

    def test_dangling_and_double_hyphens(self):
        self.assertEqual(tokenize("pre- and post-war"), ["pre", "and", "post-war"])
        self.assertEqual(tokenize("wait--what?"), ["wait", "what"])

    def test_multiple_inner_marks(self):
        self.assertEqual(tokenize("Rock'n'roll state-of-the-art"), ["rock'n'roll", "state-of-the-art"])

    def test_typographic_apostrophe(self):
        self.assertEqual(tokenize("Don\u2019t stop, it\u2019s fine"), ["don't", "stop", "it's", "fine"])

    def test_digits_with_hyphen(self):
        self.assertEqual(tokenize("COVID-19 in 2020-21"), ["covid-19", "in", "2020-21"])

    def test_empty_and_punctuation_only(self):
        self.assertEqual(tokenize(""), [])
        self.assertEqual(tokenize(" -- ' ... "), [])


class HiddenStatsTests(unittest.TestCase):
    def test_counts_use_fixed_tokenizer(self):
        self.assertEqual(word_counts("don't don\u2019t do not"), {"don't": 2, "do": 1, "not": 1})

    def test_top_words_ordering(self):
        text = "zeta alpha zeta gamma alpha beta zeta"
        self.assertEqual(top_words(text, 3), [("zeta", 3), ("alpha", 2), ("beta", 1)])
        self.assertEqual(top_words(text, 10),
                         [("zeta", 3), ("alpha", 2), ("beta", 1), ("gamma", 1)])

    def test_top_words_non_positive_n(self):
        self.assertEqual(top_words("a b c", 0), [])
        self.assertEqual(top_words("a b c", -2), [])

    def test_average_length_with_contractions(self):
        self.assertEqual(average_word_length("can't stop"), 4.5)

    def test_regression_plain_text(self):
        self.assertEqual(word_counts("One fish, two fish."), {"one": 1, "fish": 2, "two": 1})
        self.assertEqual(lexical_diversity(""), 0.0)
        self.assertEqual(top_words("x y x", 1), [("x", 2)])


if __name__ == "__main__":
    unittest.main()
