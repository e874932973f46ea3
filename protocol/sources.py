"""Where a model version's weights live: one parser of source URIs for every part.

A local source is an absolute path or a `file://` URI (percent-escapes decoded); anything else
with a scheme (`https://`, `s3://`, ...) is remote. Relative paths are refused: they would mean
something different on every host.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from urllib.parse import unquote, urlparse


class SourceUriError(ValueError):
    """A source URI that is neither an absolute path, a file:// URI nor a URL."""


def local_source_dir(source_uri: str) -> PurePosixPath | None:
    """The directory of a local source (`/abs/path` or `file:///abs/path`), else None."""
    if source_uri.startswith("/"):
        return PurePosixPath(source_uri)
    parsed = urlparse(source_uri)
    if parsed.scheme == "file":
        path = unquote(parsed.path)
        if parsed.netloc not in ("", "localhost") or not path.startswith("/"):
            return None
        return PurePosixPath(path)
    return None


def check_source_uri(source_uri: str) -> str:
    """SOURCE_URI unchanged when usable; `SourceUriError` naming the accepted forms otherwise."""
    if local_source_dir(source_uri) is not None:
        return source_uri
    parsed = urlparse(source_uri)
    if parsed.scheme and parsed.scheme != "file" and parsed.netloc:
        return source_uri
    raise SourceUriError(f"source_uri {source_uri!r}: use an absolute path, file:///PATH or a URL")
