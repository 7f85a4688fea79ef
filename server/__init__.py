"""commitgate: a commit boundary between AI agents and the side effects of their tools.

The public surface for tool authors is small: the context a tool may ask for,
and the three outcomes it may signal. Everything else is private modules.
"""

from commitgate.server.model.context import OperationContext
from commitgate.server.model.outcomes import AmbiguousError, PermanentError, RetryableError

__all__ = ["AmbiguousError", "OperationContext", "PermanentError", "RetryableError"]
__version__ = "0.1.0"
