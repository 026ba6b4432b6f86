"""SamplingError and how a bad value is quoted back: a leaf module, so that sampling.py and structured/spec.py
(which sampling.py reads constraints with) both import it without importing each other."""

SHOWN = 100  # characters of a bad value quoted back in an error


class SamplingError(ValueError):
    """A request setting outside what is allowed. `field` names it (None when the request as a whole is wrong)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def shown(value) -> str:
    """repr(value), cut to about SHOWN characters: a 20 MB bad value is not echoed back whole."""
    text = repr(value)
    return text if len(text) <= SHOWN else f"{text[:SHOWN]}... ({len(text)} characters)"
