"""Session / stage / pipeline tags of LLM calls, carried on a context variable.

A request to the model is tagged so that its finished output is learned into
the right shard (``(tenant, pipeline, stage)``) and the serving engine can
pick the matching shard when drafting::

    with agentspec.session("conv-42", pipeline="text2sql"):
        with agentspec.stage("SQL"):
            client.chat.completions.create(...)     # session, pipeline, stage set

Scopes nest (an inner scope overrides only the tags it names and the outer
values come back when it exits) and are safe for threads and asyncio tasks:
the tags live in a `contextvars.ContextVar`, so each thread and each task sees
its own.  Every scope is both a ``with`` and an ``async with`` context manager.

A tag is a str of 1..128 characters without NUL or other control characters;
anything else raises `InvalidArgumentError` when the scope (or call) is made.

Over HTTP the tags travel in ``X-AgentSpec-*`` headers.  A value that is not
plain printable ASCII (or holds ``%``) is sent percent-encoded (UTF-8), so the
receiving side always applies `decode_header_value` (``urllib.parse.unquote``).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from contextvars import ContextVar, Token
from dataclasses import dataclass, replace
from types import TracebackType
from urllib.parse import quote, unquote

from agentspec._core.shardkey import MAX_COMPONENT, check_tag

__all__ = [
    "HEADER_PIPELINE",
    "HEADER_SESSION",
    "HEADER_STAGE",
    "MAX_TAG_LENGTH",
    "TagScope",
    "Tags",
    "check_tag",
    "current_tags",
    "decode_header_value",
    "encode_header_value",
    "resolve",
    "session",
    "stage",
]

#: Longest allowed tag, in characters.
MAX_TAG_LENGTH = MAX_COMPONENT

#: Request header carrying the session id.
HEADER_SESSION = "X-AgentSpec-Session"
#: Request header carrying the stage.
HEADER_STAGE = "X-AgentSpec-Stage"
#: Request header carrying the pipeline.
HEADER_PIPELINE = "X-AgentSpec-Pipeline"

# Sent as is: printable ASCII without "%", not starting or ending with a space.
_HEADER_SAFE = re.compile(r"[!-$&-~](?:[ !-$&-~]*[!-$&-~])?")
_QUOTE_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%")


def encode_header_value(value: str) -> str:
    """A tag as an HTTP header value: unchanged if plain ASCII, else percent-encoded."""
    if _HEADER_SAFE.fullmatch(value):
        return value
    return quote(value, safe=_QUOTE_SAFE)


def decode_header_value(value: str) -> str:
    """Inverse of `encode_header_value` (``urllib.parse.unquote``)."""
    return unquote(value)


@dataclass(frozen=True)
class Tags:
    """The tags in effect for a call; None means "not tagged"."""

    session: str | None = None
    stage: str | None = None
    pipeline: str | None = None


_EMPTY = Tags()
_TAGS: ContextVar[Tags] = ContextVar("agentspec_tags", default=_EMPTY)


def current_tags() -> Tags:
    """The tags set by the innermost enclosing scopes of this thread / task."""
    return _TAGS.get()


class TagScope:
    """A context manager (``with`` or ``async with``) that sets some tags.

    Tags left None are inherited from the enclosing scope.  Entering returns
    the resulting `Tags`.  One scope object may be entered again after it
    exited, but not while it is active (nested re-entry raises RuntimeError).
    """

    __slots__ = ("_on_exit", "_overrides", "_token")

    def __init__(
        self,
        *,
        session: str | None = None,
        stage: str | None = None,
        pipeline: str | None = None,
        on_exit: Callable[[Tags], None] | None = None,
    ) -> None:
        """Check the tags now; ``on_exit`` is called with the scope's tags when it exits."""
        self._overrides = Tags(
            session=None if session is None else check_tag(session, "session"),
            stage=None if stage is None else check_tag(stage, "stage"),
            pipeline=None if pipeline is None else check_tag(pipeline, "pipeline"),
        )
        self._on_exit = on_exit
        self._token: Token[Tags] | None = None

    @property
    def tags(self) -> Tags:
        """The tags this scope sets (None where it inherits)."""
        return self._overrides

    def __enter__(self) -> Tags:
        """Set the tags; return the tags now in effect."""
        if self._token is not None:
            raise RuntimeError("this tag scope is already active")
        inner = replace(_TAGS.get(), **{k: v for k, v in _pairs(self._overrides) if v is not None})
        self._token = _TAGS.set(inner)
        return inner

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Restore the enclosing scope's tags."""
        token, self._token = self._token, None
        if token is None:
            raise RuntimeError("this tag scope was not entered")
        inner = _TAGS.get()
        _TAGS.reset(token)
        if self._on_exit is not None:
            self._on_exit(inner)

    async def __aenter__(self) -> Tags:
        """Same as ``__enter__``."""
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Same as ``__exit__``."""
        self.__exit__(exc_type, exc, tb)

    def __repr__(self) -> str:
        """``TagScope(session=..., stage=..., pipeline=...)`` (set tags only)."""
        parts = [f"{k}={v!r}" for k, v in _pairs(self._overrides) if v is not None]
        return f"TagScope({', '.join(parts)})"


def _pairs(tags: Tags) -> tuple[tuple[str, str | None], ...]:
    """``(name, value)`` pairs of a `Tags`."""
    return (("session", tags.session), ("stage", tags.stage), ("pipeline", tags.pipeline))


def stage(name: str) -> TagScope:
    """A scope tagging the calls made inside it with stage ``name``."""
    return TagScope(stage=name)


def session(
    session_id: str | None = None,
    *,
    pipeline: str | None = None,
    stage: str | None = None,
) -> TagScope:
    """A scope for one session (conversation); a random id is made if none is given.

    ``pipeline`` and ``stage``, when given, are set too.
    """
    if session_id is None:
        session_id = uuid.uuid4().hex
    return TagScope(session=session_id, pipeline=pipeline, stage=stage)


def resolve(session: object, stage: object, pipeline: object) -> Tags:
    """The tags of one call: per-call values (checked; None = not given) over the context."""
    tags = _TAGS.get()
    if session is None and stage is None and pipeline is None:
        return tags
    return Tags(
        session=tags.session if session is None else check_tag(session, "session"),
        stage=tags.stage if stage is None else check_tag(stage, "stage"),
        pipeline=tags.pipeline if pipeline is None else check_tag(pipeline, "pipeline"),
    )
