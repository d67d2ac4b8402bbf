"""Back ends: one contract (base.py), opened from typed options (options.py)."""
from .base import Backend
from .options import BACKENDS, BackendOptionError, BackendOptions, open_backend

__all__ = ["BACKENDS", "Backend", "BackendOptionError", "BackendOptions", "open_backend"]
