"""The registry's error: a damaged, foreign or too-new database, or an invalid record."""

from prism_serve.errors import PrismError


class RegistryError(PrismError):
    """The registry cannot be opened, read or written as asked; the message says why."""


class MissingRegistry(RegistryError):
    """A registry opened for reading does not exist (nothing is created in its place)."""
