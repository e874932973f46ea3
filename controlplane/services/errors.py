"""Domain errors of the service layer; the API maps each to one HTTP status (api/errors.py).

Every message says what to do next; none carries server paths or secrets.
"""

from __future__ import annotations


class DomainError(Exception):
    """Base of every service error: `message` is for the person who asked."""

    status = 400
    code = "bad_request"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFound(DomainError):
    """The named thing does not exist."""

    status = 404
    code = "not_found"

    def __init__(self, what: str) -> None:
        super().__init__(f"{what} not found")


class Conflict(DomainError):
    """The request contradicts what is stored (a name taken, a version registered differently)."""

    status = 409
    code = "conflict"


class Invalid(DomainError):
    """Well-formed, but asks for something impossible (an unknown version, a bad engine config)."""

    status = 422
    code = "invalid_request"


class Forbidden(DomainError):
    """The caller may not do this, whatever its role (e.g. a path outside the allowed roots)."""

    status = 403
    code = "forbidden"


class FileUnavailable(DomainError):
    """A version's file cannot be served: missing, outside its source, or unlike the manifest.

    One answer for all three, so the file route is no oracle for what exists on the server.
    """

    status = 404
    code = "file_unavailable"


class NotLocal(DomainError):
    """A version's files live elsewhere than on the control plane's disk: fetch them there."""

    status = 404
    code = "not_local"
