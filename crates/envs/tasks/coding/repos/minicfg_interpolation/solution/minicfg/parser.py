"""Parsing INI-style text."""

from .errors import ParseError

DEFAULT = "DEFAULT"


def parse(text):
    """Parse INI-style ``text`` into ``{section: {option: value}}``.

    - Blank lines and lines whose first non-blank character is ``#`` or
      ``;`` are ignored.
    - ``[name]`` starts a section; options before the first header belong to
      the ``DEFAULT`` section, which is always present in the result.
      Repeating a header continues the same section.
    - ``option = value`` lines are split at the first ``=``; option names
      are stripped and lower-cased, values are stripped. A later
      assignment to the same option wins.
    - Any other line raises ParseError carrying the 1-based line number.
    """
    sections = {DEFAULT: {}}
    current = DEFAULT
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1].strip()
            if not current:
                raise ParseError("empty section name", lineno)
            sections.setdefault(current, {})
            continue
        if "=" not in line:
            raise ParseError(f"expected 'option = value', got {line!r}", lineno)
        option, _, value = line.partition("=")
        option = option.strip().lower()
        if not option:
            raise ParseError("missing option name", lineno)
        sections[current][option] = value.strip()
    return sections
