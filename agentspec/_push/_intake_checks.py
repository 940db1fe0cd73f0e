"""Checks of `agentspec._push.intake.ShardIntake` that run before any tree is built.

The shard key of the query, the content type, the shard header (400 when
malformed, 409 for another depth), the token ids against the vocabulary
(422), and the build itself: every refusal raises `_RefusedError` with its
answer.
"""

from __future__ import annotations

from collections.abc import Mapping

from agentspec._core import lowlevel
from agentspec._core.tree import SuffixTree
from agentspec._push._intake_base import _IntakeBase, _RefusedError
from agentspec._push.wire import (
    SHARD_CONTENT_TYPE,
    ErrorType,
    ShardKey,
    decode_key_query,
)
from agentspec.exceptions import InvalidArgumentError, ShardFormatError


class _ShardChecks(_IntakeBase):
    """Refuses bad shard keys, content types and shard bytes before anything is built."""

    def _check_shard(self, data: bytes | bytearray | memoryview) -> None:
        """Refuse shard bytes before anything is built from them.

        The header alone (O(1)) decides a malformed header (400) and a depth
        mismatch (409); with a ``vocab_size``, one pass over the validated
        bytes finds their largest token id (422 when outside the vocabulary).
        Building a tree costs about tokens x depth, so a shard that will be
        refused never costs more than reading it.
        """
        self._check_header(data)
        self._check_vocab(data)

    def _check_header(self, data: bytes | bytearray | memoryview) -> tuple[int, int, int]:
        """``(kind, n_sequences, n_removals)`` from the header (400, 409 raise)."""
        try:
            kind, depth, n_seq, n_rem = lowlevel.shard_peek(data)
        except ShardFormatError as e:
            raise _RefusedError(self._format_error(e)) from None
        if depth != self.max_depth:
            raise _RefusedError(
                self._error(
                    409,
                    f"shard max_depth {depth} differs from the worker's {self.max_depth}",
                    ErrorType.DEPTH_MISMATCH,
                )
            )
        return kind, n_seq, n_rem

    def _check_vocab(self, data: bytes | bytearray | memoryview) -> None:
        """With a ``vocab_size``: 422 for shard bytes holding an id outside it."""
        vocab = self._vocab_size
        if vocab is not None:
            try:
                top = lowlevel.shard_max_token(data)
            except ShardFormatError as e:
                raise _RefusedError(self._format_error(e)) from None
            if top >= vocab:
                raise _RefusedError(
                    self._error(
                        422,
                        f"shard holds token id {top}, outside the worker's vocabulary "
                        f"of {vocab} tokens (ids 0..{vocab - 1}); was it learned with "
                        "another tokenizer?",
                        ErrorType.OUT_OF_VOCABULARY,
                    )
                )

    def _build(self, data: bytes | bytearray | memoryview) -> SuffixTree:
        """A new tree from snapshot bytes, checked first (no lock held)."""
        self._check_shard(data)
        return self._build_checked(data)

    def _build_checked(self, data: bytes | bytearray | memoryview) -> SuffixTree:
        """A new tree from snapshot bytes whose header was checked."""
        try:
            tree = SuffixTree.from_bytes(data)
        except ShardFormatError as e:
            raise _RefusedError(self._format_error(e)) from None
        if tree.max_depth != self.max_depth:  # the header said otherwise: cannot happen
            tree.close()
            raise _RefusedError(self._error(409, "shard depth mismatch", ErrorType.DEPTH_MISMATCH))
        return tree

    def _key(self, query: str) -> ShardKey:
        """The shard key of a query string (400 when invalid)."""
        try:
            return decode_key_query(query)
        except InvalidArgumentError as e:
            raise _RefusedError(self._error(400, str(e), ErrorType.INVALID_REQUEST)) from None

    def _check_content_type(self, headers: Mapping[str, str]) -> None:
        """Shard bytes must be sent as `SHARD_CONTENT_TYPE` (or untyped)."""
        ctype = headers.get("content-type")
        if ctype is None:
            return
        base = ctype.split(";")[0].strip().lower()
        if base not in (SHARD_CONTENT_TYPE, "application/octet-stream"):
            raise _RefusedError(
                self._error(
                    415,
                    f"shard bytes must be sent as {SHARD_CONTENT_TYPE}, not {base[:80]}",
                    ErrorType.UNSUPPORTED_MEDIA_TYPE,
                )
            )
