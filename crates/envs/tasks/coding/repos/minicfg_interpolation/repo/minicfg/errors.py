"""Exceptions raised by minicfg."""


class ConfigError(Exception):
    """Base class for all minicfg errors."""


class ParseError(ConfigError):
    """The configuration text is malformed."""

    def __init__(self, message, lineno):
        super().__init__(f"line {lineno}: {message}")
        self.lineno = lineno


class MissingOptionError(ConfigError, KeyError):
    """The requested section/option does not exist."""

    def __init__(self, section, option):
        super().__init__(section, option)
        self.section = section
        self.option = option

    def __str__(self):
        return f"no option {self.option!r} in section {self.section!r}"


class InterpolationError(ConfigError):
    """A ${...} reference cannot be resolved."""
