"""torchft, imported on first use, and the error that names the extra without it.

torchft (``pip install 'fsync[ft]'``) is an extra: ``import fsync.ft`` works without
it, and the first use of a torchft name (a lighthouse, a Manager, the names of its
process group) raises an ``ImportError`` that says how to install it.

Owns: the import of torchft and its error. May import: nothing of fsync (torchft,
lazily).
"""

from __future__ import annotations

import importlib
from typing import Any

EXTRA = "ft"
_MISSING = (
    "fsync.ft needs torchft, which is not installed: pip install 'fsync[{extra}]' (torchft "
    "0.2.0). {error}"
)


def module(name: str = "") -> Any:
    """``torchft`` (or its submodule ``name``), imported on first use."""
    try:
        return importlib.import_module("torchft" + (f".{name}" if name else ""))
    except ImportError as error:
        raise ImportError(_MISSING.format(extra=EXTRA, error=error)) from error


def torchft() -> Any:
    """The ``torchft`` module, imported on first use; a clear ``ImportError`` without it."""
    return module()
