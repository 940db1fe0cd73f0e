"""Teeing openai streams: the caller keeps its real ``Stream`` / ``AsyncStream``.

The stream's private ``_iterator`` (which both ``__iter__`` and ``__next__``
read) is swapped for a generator that yields the same items and keeps them;
when the stream is read to its end, the kept items are handed to
``on_done``.  A stream closed or abandoned before its end hands nothing over
(an incomplete output is not learned).  The per-item cost on the caller's path
is one generator step and a list append.

``on_exit``, when given, is called once when the stream stops -- read to its
end, failed, or closed early (``stream.close()``, which then also closes the
tee) -- with the items read so far and the exception that stopped it (None at
the end or on a close).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator, Iterator
from typing import Any

__all__ = ["OnExit", "tee_async_stream", "tee_stream"]

#: ``on_exit(items, exception)``: the stream stopped (exception None: its end, or a close).
OnExit = Callable[[list[Any], BaseException | None], object]


class _Exit:
    """Calls ``on_exit`` once (from the generator's end or from the stream's close)."""

    __slots__ = ("done", "on_exit")

    def __init__(self, on_exit: OnExit | None) -> None:
        self.on_exit = on_exit
        self.done = on_exit is None

    def __call__(self, items: list[Any], error: BaseException | None) -> None:
        if not self.done:
            self.done = True
            assert self.on_exit is not None
            self.on_exit(items, None if isinstance(error, GeneratorExit) else error)


def tee_stream(
    stream: Any, on_done: Callable[[list[Any]], object], on_exit: OnExit | None = None
) -> None:
    """Make ``stream`` (an ``openai.Stream``) call ``on_done(items)`` once fully read."""
    inner: Iterator[Any] = stream._iterator
    exit_ = _Exit(on_exit)

    def teed() -> Generator[Any, None, None]:
        items: list[Any] = []
        append = items.append
        error: BaseException | None = None
        try:
            for item in inner:
                append(item)
                yield item
        except BaseException as exc:
            error = exc
            raise
        finally:
            try:
                close = getattr(inner, "close", None)
                if close is not None:
                    close()
            finally:
                exit_(items, error)
        on_done(items)

    gen = teed()
    stream._iterator = gen
    if on_exit is not None:
        close_stream = stream.close

        def close() -> None:
            try:
                close_stream()
            finally:
                gen.close()
                exit_([], None)  # nothing read: the generator never started

        stream.close = close


def tee_async_stream(
    stream: Any, on_done: Callable[[list[Any]], object], on_exit: OnExit | None = None
) -> None:
    """Make ``stream`` (an ``openai.AsyncStream``) call ``on_done(items)`` once fully read."""
    inner: AsyncIterator[Any] = stream._iterator
    exit_ = _Exit(on_exit)

    async def teed() -> AsyncGenerator[Any, None]:
        items: list[Any] = []
        append = items.append
        error: BaseException | None = None
        try:
            async for item in inner:
                append(item)
                yield item
        except BaseException as exc:
            error = exc
            raise
        finally:
            try:
                aclose = getattr(inner, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                exit_(items, error)
        on_done(items)

    gen = teed()
    stream._iterator = gen
    if on_exit is not None:
        close_stream = stream.close

        async def close() -> None:
            try:
                await close_stream()
            finally:
                await gen.aclose()
                exit_([], None)

        stream.close = close
