"""Statistics over the words of a text."""

from collections import Counter

from .tokenize import tokenize


def word_counts(text):
    """A Counter of the words in ``text``."""
    return Counter(tokenize(text))


def top_words(text, n=10):
    """The ``n`` most frequent words as ``(word, count)`` pairs.

    Most frequent first; words with the same count are ordered
    alphabetically. ``n <= 0`` gives an empty list.
    """
    if n <= 0:
        return []
    return word_counts(text).most_common(n)


def average_word_length(text):
    """Mean length of the words in ``text``, rounded to 2 decimals (0.0 if none)."""
    words = tokenize(text)
    if not words:
        return 0.0
    return round(sum(len(w) for w in words) / len(words), 2)


def lexical_diversity(text):
    """Distinct words divided by total words, rounded to 3 decimals (0.0 if none)."""
    words = tokenize(text)
    if not words:
        return 0.0
    return round(len(set(words)) / len(words), 3)
