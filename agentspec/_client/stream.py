"""Teeing openai streams: the caller keeps its real ``Stream`` / ``AsyncStream``.

The stream's private ``_iterator`` (which both ``__iter__`` and ``__next__``
read) is swapped for a generator that yields the same items and keeps them;
when the stream is read to its end, the kept items are handed to
``on_done``.  A stream closed or abandoned before its end hands nothing over
(an incomplete output is not learned).  The per-item cost on the caller's path
is one generator step and a list append.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

__all__ = ["tee_async_stream", "tee_stream"]


def tee_stream(stream: Any, on_done: Callable[[list[Any]], object]) -> None:
    """Make ``stream`` (an ``openai.Stream``) call ``on_done(items)`` once fully read."""
    inner: Iterator[Any] = stream._iterator

    def teed() -> Iterator[Any]:
        items: list[Any] = []
        append = items.append
        try:
            for item in inner:
                append(item)
                yield item
        finally:
            close = getattr(inner, "close", None)
            if close is not None:
                close()
        on_done(items)

    stream._iterator = teed()


def tee_async_stream(stream: Any, on_done: Callable[[list[Any]], object]) -> None:
    """Make ``stream`` (an ``openai.AsyncStream``) call ``on_done(items)`` once fully read."""
    inner: AsyncIterator[Any] = stream._iterator

    async def teed() -> AsyncIterator[Any]:
        items: list[Any] = []
        append = items.append
        try:
            async for item in inner:
                append(item)
                yield item
        finally:
            aclose = getattr(inner, "aclose", None)
            if aclose is not None:
                await aclose()
        on_done(items)

    stream._iterator = teed()
