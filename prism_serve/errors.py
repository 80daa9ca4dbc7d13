"""One error hierarchy for the whole product; the CLI turns these into one-line messages."""


class PrismError(Exception):
    """Base class of every error prism-serve raises on purpose."""


class ProgramError(PrismError):
    """A tensor program is malformed: unknown op, cycle, shape mismatch, bad JSON."""


class SGraphError(PrismError):
    """An sGraph is malformed, or an instantiation of it is invalid for a shape or GPU."""


class CodegenError(PrismError):
    """Triton code could not be generated or loaded for an instantiated sGraph."""
