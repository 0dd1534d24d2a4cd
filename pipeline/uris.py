"""Locations: a local path or a URI (``s3://``, ``gs://``, ``file://``, any fsspec/pyarrow filesystem),
the credentials a URI may carry, and whole files read and written at either.

A URI reaches the console, the logs, MLflow params and ``config.yaml``; a credential inside it
(``user:password@host``, a token as the user name, ``?token=...``, a presigned ``X-Amz-Signature``)
must reach none of them. ``credentials_in`` says what kind of secret a URI holds without quoting it
(validation refuses such URIs); ``redact`` masks every secret in any text that names URIs, so an
error message from a filesystem or a server can be printed. ``location_problem`` is the rule every
configured path and URI passes before anything is written there.
"""
from __future__ import annotations

import errno
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Literal
from urllib.parse import parse_qsl, urlsplit

MASK = "***"

# Schemes whose user name is an account the store authenticates separately (PGPASSWORD, Kerberos,
# ssh keys), not itself a secret; anywhere else (http basic auth above all) a bare user is a token.
_USER_IS_ACCOUNT = {"postgresql", "postgres", "mysql", "mssql", "oracle", "hdfs", "webhdfs", "sftp", "ssh"}
# Query parameters that carry a secret: tokens, keys, passwords, and the signatures of presigned
# S3 / GCS URLs and Azure SAS tokens.
_SECRET_QUERY = re.compile(
    r"(token|secret|passw(or)?d|pwd|api[-_]?key|access[-_]?key|credential|signature|^sig$|^auth|^key$|^code$)",
    re.IGNORECASE,
)
# A URI inside free text: scheme://, then everything up to whitespace or a quote.
_URI_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]+")


def is_uri(location: str) -> bool:
    """A location with a scheme (``s3://``, ``file://``, ``http://``), as opposed to a local path."""
    return "://" in location


def absolute(location: str | None) -> str | None:
    """A local path made absolute (Ray workers run in another working directory); URIs and None as given."""
    if location is None or is_uri(location):
        return location
    return os.path.realpath(os.path.expanduser(location))  # unlike Path.resolve(), never raises on a symlink loop


def special_file_kind(path: str | Path) -> str | None:
    """What a local ``path`` that exists is when it is neither a regular file nor a directory (a FIFO, a
    device, a socket, a symbolic link that loops or points nowhere); None otherwise, absent included."""
    path = Path(path)
    if not os.path.lexists(path) or path.is_file() or path.is_dir():
        return None
    try:
        mode = path.stat().st_mode
    except OSError as err:  # the link itself exists; what it points to cannot be reached
        return "a symbolic link that loops" if err.errno == errno.ELOOP else "a symbolic link to nothing"
    kinds = {stat.S_ISFIFO: "a named pipe (FIFO)", stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device",
             stat.S_ISSOCK: "a socket"}
    return next((kind for test, kind in kinds.items() if test(mode)), "a special file")


def join(location: str, *parts: str) -> str:
    return "/".join([location.rstrip("/"), *parts]) if is_uri(location) else str(Path(location, *parts))


def _filesystem(location: str):
    import pyarrow.fs  # here: most commands never read a URI, and pyarrow's import costs time

    return pyarrow.fs.FileSystem.from_uri(location)


def write_bytes(location: str, data: bytes) -> None:
    """``data`` as the file at ``location`` (a local path or a URI), its parent created; a local
    file appears complete or not at all (written beside, then renamed), as an object store's does."""
    if not is_uri(location):
        from pipeline.atomic import write_bytes_atomically

        final = Path(location)
        final.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomically(final, data)
        return
    fs, path = _filesystem(location)
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with fs.open_output_stream(path) as stream:
        stream.write(data)


def read_bytes(location: str, length: int | None = None, offset: int = 0) -> bytes | None:
    """The file at ``location`` (``length`` bytes from ``offset``: all of it by default); None when there is none."""
    if not is_uri(location):
        if not Path(location).is_file():
            return None
        with open(location, "rb") as handle:
            handle.seek(offset)
            return handle.read() if length is None else handle.read(length)
    import pyarrow.fs

    fs, path = _filesystem(location)
    if fs.get_file_info(path).type != pyarrow.fs.FileType.File:
        return None
    with fs.open_input_file(path) as handle:  # random access: a header is read without the rest
        return handle.read_at(handle.size() - offset if length is None else length, offset)


def credentials_in(uri: str) -> str | None:
    """What kind of credential ``uri`` carries (never the credential itself), else None.

    A URI that cannot be parsed counts as carrying one when it has an ``@`` in its authority:
    it cannot be shown to be safe.
    """
    try:
        parts = urlsplit(uri)
        password, username = parts.password, parts.username
    except ValueError:
        return "userinfo (user@host) in a URI that cannot be parsed" if "@" in uri.partition("://")[2].split("/")[0] else None
    if password is not None:
        return "a password (user:password@host)"
    if username is not None and parts.scheme.lower() not in _USER_IS_ACCOUNT:
        return f"a user name ({parts.scheme}://NAME@host), sent as a credential (a token)"
    secret_keys = [key for key, _ in parse_qsl(parts.query, keep_blank_values=True) if _SECRET_QUERY.search(key)]
    if secret_keys:
        return f"a secret query parameter ({', '.join(dict.fromkeys(secret_keys))})"
    return None


def redact(text: str) -> str:
    """``text`` with every URI's credentials replaced by ``***``: userinfo and secret query values.

    Takes a bare URI or any message naming URIs (an exception's text, a log line).
    """
    return _URI_IN_TEXT.sub(lambda match: _redact_uri(match.group(0)), text)


def _redact_uri(uri: str) -> str:
    scheme, _, rest = uri.partition("://")
    authority, slash, path = rest.partition("/")
    if "@" in authority:  # everything before the last @ is userinfo, whether or not it parses
        authority = f"{MASK}@{authority.rpartition('@')[2]}"
    if "?" in path or "?" in authority:
        head, _, tail = (authority + slash + path).partition("?")
        query, hash_mark, fragment = tail.partition("#")
        masked = "&".join(_mask_parameter(item) for item in query.split("&"))
        return f"{scheme}://{head}?{masked}{hash_mark}{fragment}"
    return f"{scheme}://{authority}{slash}{path}"


def _mask_parameter(item: str) -> str:
    key, equals, _ = item.partition("=")
    return f"{key}={MASK}" if equals and _SECRET_QUERY.search(key) else item


def uri_password_problem(uri: str) -> str | None:
    """Why ``uri`` cannot be an MLflow tracking URI (malformed, or carries a credential), else None.

    Never quotes the credential."""
    try:
        urlsplit(uri).port  # noqa: B018  (parsing the port is what rejects a malformed authority)
    except ValueError:
        return f"is not a valid URI ({redact(uri).partition('://')[2] or 'malformed host'})"
    credential = credentials_in(uri)
    if credential is None:
        return None
    return (f"embeds {credential}, which would be logged as an MLflow param, saved in config.yaml and "
            "printed; give the URI without it and set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD "
            "(or MLFLOW_TRACKING_TOKEN) for an MLflow server, PGPASSWORD / ~/.pgpass for a PostgreSQL store")


def location_problem(location: str | Path | None, kind: Literal["file", "directory"] | None = None,
                     create: bool = False) -> str | None:
    """Why a local path or URI cannot be used as given, else None: a URI carrying a credential; a local
    path below an existing file (nothing can ever be created there); an existing path of the wrong
    ``kind`` (a directory given for a file, or a file for a directory); with ``create``, a path where
    this process cannot create or write a directory (a read-only or virtual filesystem, no permission)."""
    if location is None:
        return None
    location = str(location)
    if is_uri(location):
        credential = credentials_in(location)
        if credential:
            return (f"the URI embeds {credential}, which would be printed, logged and saved in config.yaml; "
                    "give it without, and the credentials to the filesystem instead (AWS_* / "
                    "GOOGLE_APPLICATION_CREDENTIALS variables, ~/.netrc, or fsspec's config)")
        return None
    path = Path(location).expanduser().absolute()
    if kind == "directory" and path.exists() and not path.is_dir():
        return f"{str(path)!r} is a file, and a directory is needed here; choose another path"
    if kind == "file" and path.is_dir():
        return f"{str(path)!r} is a directory, and a file is needed here; name the file inside it"
    blocking = next((parent for parent in path.parents if parent.exists() and not parent.is_dir()), None)
    if blocking is not None:
        return f"{str(blocking)!r} is a file, so nothing can exist below it; choose a path under a directory"
    if create:
        return _creation_problem(path.parent if kind == "file" else path)
    return None


def _creation_problem(directory: Path) -> str | None:
    """Why ``directory`` cannot be created or written in, found by creating (and removing at once) a
    directory in it or its nearest existing ancestor: root passes every permission check, yet cannot
    create anything in /proc or on a read-only mount."""
    existing = next(candidate for candidate in (directory, *directory.parents) if candidate.exists())
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".vitsweep-probe-", dir=existing))
    except OSError as err:
        reason = err.strerror or str(err)
        if existing == directory:
            return f"{str(directory)!r} is not writable: the system refuses to create anything in it ({reason})"
        return (f"{str(directory)!r} cannot be created: the system refuses to create a directory in "
                f"{str(existing)!r} ({reason})")
    return None
