"""A minimal INI-style configuration reader."""

from .config import Config
from .errors import ConfigError, InterpolationError, MissingOptionError, ParseError
from .parser import parse

__all__ = ["Config", "ConfigError", "InterpolationError", "MissingOptionError", "ParseError", "parse"]
