"""One exception tree for everything capsteer raises on purpose (httpx-style).

Every error a caller can act on derives from `CapsteerError`; each class says which
HTTP status it means, so the server maps any of them in one place
(`capsteer.server.errors`). The classes also keep their builtin bases (`ValueError`,
`KeyError`, ...) so code that caught those before still does.
"""

from __future__ import annotations


class CapsteerError(Exception):
    """Base of capsteer's errors; `status` is the HTTP status a request failing with
    it gets, `param` the request field it names, when there is one."""

    status: int = 500
    param: str | None = None


class InvalidInput(CapsteerError):
    """Input that can never work as given: a bad field, name, size or file (400)."""

    status = 400


class NotFound(CapsteerError):
    """A named thing (vector, capture, reader) that does not exist (404)."""

    status = 404


class AtCapacity(CapsteerError):
    """The server is at a bound it will not pass; retrying later may work (429)."""

    status = 429


class Unsupported(CapsteerError):
    """A model, engine feature or platform capsteer refuses to run with, by name."""


class StorageError(CapsteerError):
    """Captured data that could not be written, read or verified."""
