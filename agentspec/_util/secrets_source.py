"""Where a Redis URL comes from, without it ever passing through argv or output.

A URL on the command line (``--redis redis://user:pw@host``) is readable by every
local user in ``/proc/PID/cmdline`` and ``ps``.  The commands that take
``--redis`` therefore also take the URL from

- ``--redis-file PATH``: a file holding the URL (whitespace around it stripped);
- ``$AGENTSPEC_REDIS_URL``: the URL itself (a process's environment is readable
  by its own user only);
- ``$AGENTSPEC_REDIS_URL_FILE``: the path of such a file,

in that order (the flags before the variables).  A file must not grant any
permission to other users and must not be writable by its group
(``chmod 600``, or ``640`` with a service group): otherwise it is refused, as
the password would be as visible as on the command line.  `resolve` never puts
the URL into an error message; `argv_password_warning` says, without the
password, that a URL on the command line holds one.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TextIO

from agentspec.exceptions import InvalidArgumentError

__all__ = [
    "FLEET_URL_SCHEMES",
    "REDIS_SCHEMES",
    "REDIS_URL_ENV",
    "REDIS_URL_FILE_ENV",
    "RedisUrl",
    "RedisUrlError",
    "add_arguments",
    "argv_password_warning",
    "from_args",
    "has_password",
    "read_url_file",
    "resolve",
    "warn_if_password_in_argv",
]

#: The Redis URL itself.
REDIS_URL_ENV = "AGENTSPEC_REDIS_URL"
#: The path of a file holding the Redis URL.
REDIS_URL_FILE_ENV = "AGENTSPEC_REDIS_URL_FILE"
#: The schemes a fleet URL may have.
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
#: Schemes only the fleet's own clients take (`agentspec._fleet.connection.open_client`).
_FLEET_ONLY_SCHEMES = ("redis+sentinel://", "redis+cluster://")
#: Every scheme a fleet URL may have.
FLEET_URL_SCHEMES = REDIS_SCHEMES + _FLEET_ONLY_SCHEMES
#: Largest URL file read (a URL is short; anything bigger is the wrong file).
_MAX_FILE_BYTES = 64 * 1024
#: Permission bits a URL file must not have: any for others, write for the group.
_FORBIDDEN_MODE = stat.S_IRWXO | stat.S_IWGRP


class RedisUrlError(InvalidArgumentError):
    """The Redis URL could not be taken from where it was given (a usage error)."""


@dataclass(frozen=True)
class RedisUrl:
    """A resolved Redis URL and where it came from.

    ``source`` is ``"argv"`` (``--redis``), ``"file"`` (``--redis-file`` or
    ``$AGENTSPEC_REDIS_URL_FILE``; ``path`` is then the file's absolute path) or
    ``"env"`` (``$AGENTSPEC_REDIS_URL``).  The repr never shows the URL.
    """

    url: str = field(repr=False)
    source: str
    path: str | None = None


def has_password(url: str) -> bool:
    """Whether ``url`` holds a password (user-info or a ``password=`` parameter)."""
    try:
        parts = urllib.parse.urlsplit(url)
        if parts.password:
            return True
        return any(
            k.lower() == "password" and v
            for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        )
    except ValueError:
        return "@" in url  # unparsable: assume the worst


def _check_url(url: str, where: str) -> str:
    """``url`` when it is one Redis URL; the error names ``where``, never the text."""
    if not url:
        raise RedisUrlError(f"{where} is empty: it must hold a Redis URL")
    if any(c.isspace() for c in url):
        raise RedisUrlError(f"{where} must hold one URL (it holds whitespace inside)")
    if not url.startswith(REDIS_SCHEMES + _FLEET_ONLY_SCHEMES):
        raise RedisUrlError(
            f"{where} must hold a redis://, rediss://, unix://, redis+sentinel:// or "
            "redis+cluster:// URL"
        )
    return url


def read_url_file(path: str, where: str = "--redis-file") -> str:
    """The URL held by the file ``path`` (whitespace around it stripped).

    Raises:
        RedisUrlError: the file is missing or unreadable, grants permissions to
            other users (or write to its group), or holds no single Redis URL.
            The message names the file and never its content.
    """
    label = f"{where} {path}"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise RedisUrlError(f"cannot read {label}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RedisUrlError(f"{label} is not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        if os.name == "posix" and mode & _FORBIDDEN_MODE:
            raise RedisUrlError(
                f"{label} has mode {mode:04o}: other users could read or change the Redis "
                f"password in it; allow only its owner (chmod 600 {path}, or 640 for a "
                "group that runs the service)"
            )
        data = os.read(fd, _MAX_FILE_BYTES + 1)
    except OSError as e:
        raise RedisUrlError(f"cannot read {label}: {e.strerror or e}") from None
    finally:
        os.close(fd)
    if len(data) > _MAX_FILE_BYTES:
        raise RedisUrlError(f"{label} is larger than {_MAX_FILE_BYTES} bytes: not a URL file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise RedisUrlError(f"{label} is not UTF-8 text") from None
    return _check_url(text.strip(), label)


def resolve(
    url: str | None = None,
    url_file: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> RedisUrl | None:
    """The Redis URL from ``--redis``, ``--redis-file``, then the environment (None: none given).

    Args:
        url: ``--redis`` (checked for its scheme only).
        url_file: ``--redis-file``.
        environ: the environment (default `os.environ`); empty variables are unset.

    Raises:
        RedisUrlError: both flags, or both variables, are given; a file cannot
            be used (`read_url_file`); a URL has the wrong scheme.
    """
    if url and url_file:
        raise RedisUrlError("give either --redis or --redis-file, not both")
    if url:
        return RedisUrl(_check_url(url, "--redis"), "argv")
    if url_file:
        return RedisUrl(read_url_file(url_file), "file", os.path.abspath(url_file))
    env = os.environ if environ is None else environ
    env_url = env.get(REDIS_URL_ENV) or None
    env_file = env.get(REDIS_URL_FILE_ENV) or None
    if env_url and env_file:
        raise RedisUrlError(f"set either ${REDIS_URL_ENV} or ${REDIS_URL_FILE_ENV}, not both")
    if env_url:
        return RedisUrl(_check_url(env_url.strip(), f"${REDIS_URL_ENV}"), "env")
    if env_file:
        url_text = read_url_file(env_file, f"${REDIS_URL_FILE_ENV}")
        return RedisUrl(url_text, "file", os.path.abspath(env_file))
    return None


def argv_password_warning(flag: str = "--redis") -> str:
    """The one-line warning for a password on the command line (it names no password)."""
    return (
        f"agentspec: warning: the {flag} URL holds a password, which every local user can "
        f"read in the process list; give it in ${REDIS_URL_ENV}, or in a file "
        f"(--redis-file PATH or ${REDIS_URL_FILE_ENV}, mode 600)"
    )


def warn_if_password_in_argv(
    resolved: RedisUrl | None, flag: str = "--redis", stream: TextIO | None = None
) -> bool:
    """Print `argv_password_warning` on stderr when ``resolved`` came from argv with a password.

    Returns whether it warned.
    """
    if resolved is None or resolved.source != "argv" or not has_password(resolved.url):
        return False
    print(argv_password_warning(flag), file=stream if stream is not None else sys.stderr)
    return True


def add_arguments(parser: argparse.ArgumentParser, url_help: str) -> None:
    """Add ``--redis URL`` (with ``url_help``) and ``--redis-file PATH`` to ``parser``."""
    parser.add_argument("--redis", default=None, metavar="URL", help=url_help)
    parser.add_argument(
        "--redis-file",
        default=None,
        metavar="PATH",
        help=f"a file holding the Redis URL, readable by its owner only (chmod 600; default: "
        f"${REDIS_URL_FILE_ENV}). Unlike --redis, keeps the password out of the process "
        f"list; so does ${REDIS_URL_ENV}",
    )


def from_args(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> RedisUrl | None:
    """`resolve` for parsed ``--redis`` / ``--redis-file``, warning about a password in argv."""
    resolved = resolve(getattr(args, "redis", None), getattr(args, "redis_file", None), environ)
    warn_if_password_in_argv(resolved)
    return resolved
