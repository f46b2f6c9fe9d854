"""Errors a user can act on. Each is a ValueError so callers can treat bad input uniformly."""


class AerieError(ValueError):
    """Base class of every error Aerie raises for bad input, bad files or bad settings."""


class InvalidRequestError(AerieError):
    """A request (prompt or sampling parameters) that cannot be served as given."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthExceededError(InvalidRequestError):
    """The prompt, or the prompt plus max_tokens, does not fit in the model's context."""


class ModelLoadError(AerieError):
    """A model or head that is missing, corrupt, or cannot be converted."""


class UnsupportedArchitectureError(ModelLoadError):
    """A checkpoint whose architecture Aerie does not implement."""
