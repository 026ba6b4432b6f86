"""The import path docs/generation.md showed for `Structured` before structured output became a package:
`from jaxgen.inference.grammar import Structured` keeps working. New code imports `jaxgen.inference.structured`."""

from jaxgen.inference.structured.spec import Structured

__all__ = ["Structured"]
