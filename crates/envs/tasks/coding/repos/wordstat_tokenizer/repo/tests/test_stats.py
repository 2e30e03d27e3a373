import unittest

from wordstat import average_word_length, lexical_diversity, top_words, word_counts


class StatsTests(unittest.TestCase):
    def test_word_counts(self):
        self.assertEqual(word_counts("a b a"), {"a": 2, "b": 1})

    def test_top_words_ties_are_alphabetical(self):
        self.assertEqual(top_words("b a b a c", 2), [("a", 2), ("b", 2)])

    def test_average_word_length(self):
        self.assertEqual(average_word_length("ab abcd"), 3.0)
        self.assertEqual(average_word_length(""), 0.0)

    def test_lexical_diversity(self):
        self.assertEqual(lexical_diversity("to be or not to be"), 0.667)


if __name__ == "__main__":
    unittest.main()
