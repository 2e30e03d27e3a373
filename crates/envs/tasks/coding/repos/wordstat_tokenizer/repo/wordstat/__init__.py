"""Small text statistics helpers."""

from .stats import average_word_length, lexical_diversity, top_words, word_counts
from .tokenize import tokenize

__all__ = ["average_word_length", "lexical_diversity", "tokenize", "top_words", "word_counts"]
