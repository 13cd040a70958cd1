"""Errors the engine raises to its callers."""


class EngineError(RuntimeError):
    """Generation failed inside the engine."""


class EngineFullError(RuntimeError):
    """The admission queue is full: retry later or on another worker."""
