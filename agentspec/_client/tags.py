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

Over HTTP the tags travel in ``vllm_xargs`` and in ``X-AgentSpec-*`` headers;
their names, the rules for a tag and the header codec are `agentspec.protocol`'s
(re-exported here).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from contextvars import ContextVar, Token
from dataclasses import dataclass, replace
from types import TracebackType

from agentspec.protocol import (
    HEADER_PIPELINE,
    HEADER_SESSION,
    HEADER_STAGE,
    MAX_TAG_LENGTH,
    check_tag,
    decode_header_value,
    encode_header_value,
)

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
