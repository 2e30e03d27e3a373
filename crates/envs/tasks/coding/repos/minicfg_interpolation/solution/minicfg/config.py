"""High-level access to parsed configuration."""

from .errors import InterpolationError, MissingOptionError
from .parser import DEFAULT, parse

_MISSING = object()
_TRUE = {"1", "yes", "true", "on"}
_FALSE = {"0", "no", "false", "off"}


class Config:
    """Parsed configuration with typed getters."""

    def __init__(self, sections):
        self._sections = sections

    @classmethod
    def from_string(cls, text):
        return cls(parse(text))

    def sections(self):
        """Sorted names of all sections except DEFAULT."""
        return sorted(name for name in self._sections if name != DEFAULT)

    def has_option(self, section, option):
        """True if ``option`` is set in ``section`` or in DEFAULT."""
        option = option.lower()
        if section != DEFAULT and section not in self._sections:
            return False
        return option in self._sections.get(section, {}) or option in self._sections[DEFAULT]

    def _lookup(self, section, option):
        option = option.lower()
        if section != DEFAULT and section not in self._sections:
            raise MissingOptionError(section, option)
        values = self._sections.get(section, {})
        if option in values:
            return values[option]
        if option in self._sections[DEFAULT]:
            return self._sections[DEFAULT][option]
        raise MissingOptionError(section, option)

    def get(self, section, option, fallback=_MISSING, raw=False):
        """Return the value of ``option`` in ``section``.

        Options missing from ``section`` are looked up in DEFAULT. If the
        option is missing there too, ``fallback`` is returned when given,
        otherwise MissingOptionError is raised.

        Unless ``raw`` is true, values are interpolated: ``${name}`` is
        replaced by option ``name`` of the same section (with the usual
        DEFAULT fallback), ``${section:name}`` by option ``name`` of
        ``section``. Substituted values are interpolated recursively, relative
        to the section they come from. ``$$`` is a literal ``$``; a ``$`` not
        followed by ``{`` or ``$`` is kept as is. Unknown references,
        unterminated ``${`` and reference cycles raise InterpolationError.
        """
        try:
            value = self._lookup(section, option)
        except MissingOptionError:
            if fallback is _MISSING:
                raise
            return fallback
        if raw:
            return value
        return self._interpolate(section, value, [(section, option.lower())])

    def _interpolate(self, section, value, chain):
        """Expand references in ``value`` (found in ``section``).

        ``chain`` holds the (section, option) pairs currently being expanded,
        so a reference back to one of them is a cycle.
        """
        out = []
        i = 0
        while i < len(value):
            c = value[i]
            if c != "$" or i + 1 >= len(value) or value[i + 1] not in "${":
                out.append(c)
                i += 1
                continue
            if value[i + 1] == "$":
                out.append("$")
                i += 2
                continue
            end = value.find("}", i + 2)
            if end == -1:
                raise InterpolationError(f"unterminated '${{' in {value!r}")
            ref = value[i + 2:end]
            if ":" in ref:
                ref_section, _, ref_option = ref.partition(":")
            else:
                ref_section, ref_option = section, ref
            ref_option = ref_option.lower()
            key = (ref_section, ref_option)
            if key in chain:
                path = " -> ".join(f"{s}:{o}" for s, o in chain + [key])
                raise InterpolationError(f"reference cycle: {path}")
            try:
                raw_value = self._lookup(ref_section, ref_option)
            except MissingOptionError:
                raise InterpolationError(f"bad reference ${{{ref}}} in section {section!r}") from None
            out.append(self._interpolate(ref_section, raw_value, chain + [key]))
            i = end + 1
        return "".join(out)

    def getint(self, section, option, fallback=_MISSING):
        value = self.get(section, option, fallback=fallback)
        if value is fallback:
            return value
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{section}.{option}: not an integer: {value!r}") from None

    def getbool(self, section, option, fallback=_MISSING):
        value = self.get(section, option, fallback=fallback)
        if value is fallback:
            return value
        lowered = value.lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        raise ValueError(f"{section}.{option}: not a boolean: {value!r}")
