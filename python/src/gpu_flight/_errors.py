"""Errors of the client's own: a missing optional dependency.

The server's errors are not wrapped: they reach the caller as pyarrow's own exceptions (see the
package's docstring for the mapping), carrying the server's message.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str) -> ModuleType:
    """Imports `module`, or raises ImportError naming it and the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        package = module.split(".")[0]
        raise ImportError(
            f"this needs the {package!r} package, which is not installed: "
            f"pip install 'gpu-flight[{extra}]' (or install {package} yourself)"
        ) from error
