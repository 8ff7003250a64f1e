"""capsteer: per-request activation capture and steering on stock vLLM."""

__version__ = "0.1.0"
