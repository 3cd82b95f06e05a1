"""ModelLoadError on its own, so the loaders (loader, gguf_loader, hf_loader, gguf_header) can all
raise it without importing each other in a circle."""
from __future__ import annotations


class ModelLoadError(ValueError):
    """The model argument, or the file it points at, cannot be loaded."""
