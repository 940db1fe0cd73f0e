"""Drop-in replacement for ``arctic_inference.suffix_decoding``.

`SuffixDecodingCache` has the constructor, methods and properties of
arctic-inference's class of the same name (0.3.0), so code written for it —
vLLM's ``SuffixDecodingProposer`` for instance — runs unchanged::

    from agentspec.compat import SuffixDecodingCache, SuffixDecodingDraft

Behaviour follows arctic's: a per-request tree over prompt + response, a
global tree of responses shared by all requests (in-flight responses are
visible to other requests immediately), FIFO eviction beyond
``max_cached_requests`` (-1: unlimited, 0: no global tree), and the better
of the two trees' drafts (the per-request one on ties).

Deliberate differences from arctic-inference 0.3.0 (each checked against
0.3.0 itself; docs/design-native.md has the same list), with their reasons:

Drafting

- Ties between equally counted children go to the smallest token id
  (arctic follows the child inserted first), in chains and in tree drafts:
  a draft then depends only on the counts, never on insertion history, so a
  tree rebuilt from a snapshot or delta drafts exactly like the original.
- A match may cover the whole context: pattern lengths 1 ..
  min(len(context), max_tree_depth - 1) are tried (arctic stops one short,
  at len(context) - 1).  So a one-token context can draft, and
  ``match_len`` (hence the ``max_spec_factor * match_len`` budget) can be
  one larger.  Arctic stops short to dodge the context's own occurrence;
  here that occurrence is excluded by the next point instead.
- Probabilities divide a child's count by the total of the continuations,
  not by the node's count: occurrences with no continuation (the context's
  own occurrence in the per-request tree, or in the global tree for the
  in-flight response; the end of a sequence) add no evidence.  A string seen
  once before has probability 1.0, not 0.5; scores, ``min_token_prob``
  cut-offs and which draft wins change accordingly.  Deflated probabilities
  carry no information and keep arctic's per-request search from stopping
  early.
- An empty draft always has ``match_len`` 0 (arctic reports the match
  length of a match that drafted nothing, e.g. with ``max_spec_tokens=0``):
  ``match_len`` describes the draft.
- ``speculate(max_spec_tokens=None)`` drafts up to ``max_tree_depth`` tokens
  (arctic raises AttributeError: a bug).  A value <= 0 returns an empty draft
  at once, without reading the context; values above 2**31-1 are allowed
  (arctic raises TypeError); drafts never exceed ``max_tree_depth - 1``
  tokens either way.

Tokens

- Token ids must be in [0, 2**31-1]: -1 and other negative ids raise
  `InvalidTokenError` (a ValueError; arctic accepts any int32 but INT32_MIN
  and INT32_MIN+1, its hash map's reserved keys).  Ids index a vocabulary,
  and -1 is vLLM's placeholder for a token not known yet: learned into the
  global tree it would be drafted to other requests.  Ids >= 2**31 raise
  InvalidTokenError too (arctic: TypeError).
- A numpy token array of the wrong dtype, shape or layout raises TypeError
  (arctic: ValueError), as everywhere in agentspec; any iterable of ints is
  accepted (arctic: sequences and arrays only).
- `start_request` and `add_active_response` are atomic: when they raise,
  nothing changed (arctic leaves a request whose prompt holds a bad token
  active without a global slot, and appends the tokens before a bad one to
  the per-request tree only, after which every append to it fails).

Arguments

- Stricter checks, because arctic turns these caller bugs into silently
  empty or odd drafts: ``max_tree_depth`` in [2, 1024] (arctic accepts
  anything, 0 included); ``max_cached_requests`` an int, -1 or in
  [0, 2**31-1] (arctic accepts -2 or 2.0); ``max_spec_factor`` >= 0 and
  finite, ``max_spec_offset`` finite, ``min_token_prob`` in [0, 1] (arctic
  returns no draft for a negative, NaN or infinite factor and treats a
  negative min_token_prob as 0); bool is refused where an int is expected
  (arctic takes True as 1).  Range errors are ValueError subclasses
  (`InvalidArgumentError`), type errors TypeError, naming the argument.
- Integer arguments accept any integral type (numpy scalars included, as
  arctic's binding does) and float arguments any real number: vLLM passes
  ``max_spec_tokens`` computed from an int32 array.
- ``use_tree_spec`` is truth-tested (arctic's binding accepts only bool).

Requests and eviction (the same as arctic unless listed)

- Unknown request ids (``speculate``, ``add_active_response``,
  ``stop_request``; ``evict_cached_response`` of a response not cached) and
  a duplicate ``start_request`` raise ValueError as in arctic (here
  `InvalidArgumentError`, a ValueError subclass).  Starting a request whose
  id still has a cached response evicts that response, as arctic does.
- Eviction is FIFO by request count as in arctic, plus optional budgets
  ``max_cached_tokens`` / ``max_cached_bytes`` (an extension, arctic issue
  #215) that evict the oldest cached responses (never the one being added)
  until the global tree fits.
- Global sequence ids are 64-bit and never wrap (arctic wraps them at 2**31
  and evicts a cached response whose id comes round again).

Extensions

- ``start_request(..., stage=...)`` serves the request from an
  `agentspec.Speculator` (stage shards, see its docstring): it drafts from
  its own context, so `speculate` ignores the ``context`` argument, and its
  response is learned into the shards, not listed in ``cached_requests``.
- ``global_tree``, ``max_cached_tokens`` and ``max_cached_bytes``
  properties; `SuffixDecodingDraft.from_native` takes an `agentspec.Draft`.
- Not a behaviour difference: when the context passed to `speculate` is the
  tail of what the request has seen (prompt + responses), drafting is
  incremental and costs about the match length rather than re-walking every
  pattern from the root; the draft is the same.

Not thread-safe: use one cache from one thread (as vLLM does).
"""

from __future__ import annotations

import numbers
from collections.abc import Hashable, KeysView
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agentspec._core import lowlevel
from agentspec._core.cursor import Cursor
from agentspec._core.draft import Draft, DraftParams, check_max_depth
from agentspec._core.speculator import Speculator
from agentspec._core.tokens import TokenArray, as_int32_buffer
from agentspec._core.tree import SuffixTree
from agentspec._util.args import as_int
from agentspec._util.log import get_logger
from agentspec.exceptions import InvalidArgumentError

__all__ = ["SuffixDecodingCache", "SuffixDecodingDraft"]

_MAX_CACHED_REQUESTS = 0x7FFFFFFF
_PARAMS_CACHE_SIZE = 256
#: DraftParams fields and the `SuffixDecodingCache.speculate` arguments they come from.
_ARG_NAMES = (("alpha", "max_spec_factor"), ("offset", "max_spec_offset"))


@dataclass(slots=True)
class SuffixDecodingDraft:
    """A draft returned by `SuffixDecodingCache.speculate`.

    Attributes:
        token_ids: the drafted tokens.
        parents: index of each token's parent in the draft, -1 for tokens
            that follow the context directly (a chain: ``[-1, 0, 1, ...]``).
        probs: each token's estimated acceptance probability.
        score: the sum of ``probs``.
        match_len: length of the matched context suffix (0: no draft).
    """

    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0

    @staticmethod
    def from_native(draft: Draft) -> SuffixDecodingDraft:
        """Build from an `agentspec.Draft` (arctic builds from its native Draft)."""
        return SuffixDecodingDraft(
            draft.token_ids, draft.parents, draft.probs, draft.score, draft.match_len
        )


class _Request:
    """State of one active request."""

    __slots__ = ("cursor", "seq_id", "staged", "warned")

    def __init__(self, cursor: Cursor | None, seq_id: int | None, *, staged: bool = False) -> None:
        self.cursor = cursor  # None for staged requests: the Speculator owns theirs
        self.seq_id = seq_id
        self.staged = staged
        self.warned = False


def _real(value: object, name: str) -> float:
    """A float argument of `speculate`: any real number but bool (numpy floats too)."""
    if type(value) is float:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, not {type(value).__name__}")
    return float(value)


def _check_limit(name: str, value: object) -> int | None:
    """An optional budget: None, or an int >= 0."""
    if value is None:
        return None
    return as_int(value, name, 0, expected="an int or None")


class SuffixDecodingCache:
    """Suffix-decoding state of a serving engine: per-request and global trees.

    Lifecycle of a request: `start_request` with its prompt, then per decode
    step `add_active_response` with the newly accepted tokens and
    `speculate` with the current context, then `stop_request`.  The response
    stays in the global tree (visible to later requests) until evicted.

    Args:
        max_tree_depth: depth of every tree (longest indexed string); also the
            default ``max_spec_tokens`` of `speculate`.
        max_cached_requests: responses kept in the global tree; the oldest is
            evicted first (FIFO).  -1: unlimited; 0: no global tree at all.
        max_cached_tokens: optional budget on tokens in the global tree.
        max_cached_bytes: optional budget on the global tree's memory.
    """

    def __init__(
        self,
        max_tree_depth: int = 64,
        max_cached_requests: int = -1,
        *,
        max_cached_tokens: int | None = None,
        max_cached_bytes: int | None = None,
    ) -> None:
        """Create an empty cache (see the class docstring for the arguments).

        Raises:
            InvalidArgumentError: max_tree_depth outside [2, 1024],
                max_cached_requests < -1 or > 2**31-1, a negative budget.
        """
        depth = check_max_depth(max_tree_depth, "max_tree_depth")
        max_cached_requests = as_int(max_cached_requests, "max_cached_requests")
        if not -1 <= max_cached_requests <= _MAX_CACHED_REQUESTS:
            raise InvalidArgumentError(
                f"max_cached_requests must be -1 (unlimited) or in [0, {_MAX_CACHED_REQUESTS}]",
                f"got {max_cached_requests}",
            )
        self._max_tokens = _check_limit("max_cached_tokens", max_cached_tokens)
        self._max_bytes = _check_limit("max_cached_bytes", max_cached_bytes)
        self._max_tree_depth = depth
        self._max_cached_requests = max_cached_requests
        self._global = SuffixTree(depth)
        self._use_global = max_cached_requests != 0
        self._draft_global = self._global if self._use_global else None  # speculate's tree
        self._active: dict[Hashable, _Request] = {}
        # Cached responses, oldest first: request id -> sequence id in the global tree.
        self._cached: dict[Hashable, int] = {}
        self._next_seq_id = 0
        self._params: dict[tuple[Any, ...], DraftParams] = {}
        # speculate's raw arguments (exact builtin types) -> DraftParams
        self._fast_params: dict[tuple[Any, ...], DraftParams] = {}
        # The arguments of the last checked call and their params (compared by identity).
        self._last: tuple[Any, ...] = (_NONE,) * 6
        self._default_spec = min(depth, lowlevel.MAX_SPEC_LIMIT)
        self._speculator: Speculator | None = None  # stage shards, made on first use

    # --- properties (arctic's) ---------------------------------------------

    @property
    def max_tree_depth(self) -> int:
        """Depth of the trees."""
        return self._max_tree_depth

    @property
    def max_cached_requests(self) -> int:
        """Most responses kept in the global tree (-1: unlimited, 0: none)."""
        return self._max_cached_requests

    @property
    def active_requests(self) -> KeysView[Hashable]:
        """Ids of requests between `start_request` and `stop_request`."""
        return self._active.keys()

    @property
    def cached_requests(self) -> KeysView[Hashable]:
        """Ids of requests whose response is in the global tree, oldest first."""
        return self._cached.keys()

    # --- extensions --------------------------------------------------------

    @property
    def max_cached_tokens(self) -> int | None:
        """Token budget of the global tree (None: none)."""
        return self._max_tokens

    @property
    def max_cached_bytes(self) -> int | None:
        """Memory budget of the global tree in bytes (None: none)."""
        return self._max_bytes

    @property
    def global_tree(self) -> SuffixTree:
        """The global tree of cached responses (read it, do not modify it)."""
        return self._global

    # --- request lifecycle ---------------------------------------------------

    def start_request(
        self, req_id: Hashable, prompt_token_ids: TokenArray, *, stage: str | None = None
    ) -> None:
        """Register a new request with its prompt.

        A cached response of an earlier request with the same id is evicted.
        On any error nothing is registered and nothing is evicted.

        With ``stage`` (an agentspec extension) the request goes through an
        `agentspec.Speculator` instead: it drafts from its own tree, its
        stage's shard and a tree over all staged responses, and its response
        is learned into them when it stops (it is not among
        ``cached_requests``).  A staged request drafts from its own context
        (prompt + responses), so ``speculate``'s context must be its tail.

        Raises:
            ValueError (InvalidArgumentError): the request is already active.
            TypeError, InvalidTokenError: bad prompt tokens.
        """
        hash(req_id)
        if req_id in self._active:
            raise InvalidArgumentError(f"request {req_id!r} is already active")
        if stage is not None:
            self._stages().start_request(req_id, prompt_token_ids, stage=stage)
            self._active[req_id] = _Request(None, None, staged=True)
            return
        keep = as_int32_buffer(prompt_token_ids)[2]
        cursor = Cursor(self._max_tree_depth, local_tree=True, prompt=keep)
        # Nothing below can fail on user input: commit.
        seq_id: int | None = None
        if self._use_global:
            if req_id in self._cached:
                self._evict(req_id)
            seq_id = self._next_seq_id
            self._next_seq_id += 1
            self._cached[req_id] = seq_id
            self._enforce_count(req_id)
        self._active[req_id] = _Request(cursor, seq_id)

    def stop_request(self, req_id: Hashable) -> None:
        """End a request: its response stays cached (closed), its own tree is freed.

        Raises:
            ValueError (InvalidArgumentError): the request is not active.
        """
        req = self._active.pop(req_id, None)
        if req is None:
            raise InvalidArgumentError(f"request {req_id!r} is not active")
        if req.cursor is None:
            self._stages().finish(req_id)
            return
        seq_id = req.seq_id
        if seq_id is not None and self._cached.get(req_id) == seq_id and seq_id in self._global:
            self._global.close_sequence(seq_id)
        req.cursor.close()

    def add_active_response(self, req_id: Hashable, token_ids: TokenArray) -> None:
        """Append newly generated tokens to a request (its tree and the global tree).

        Raises:
            ValueError (InvalidArgumentError): the request is not active.
            TypeError, InvalidTokenError: bad tokens (nothing is appended).
        """
        req = self._active.get(req_id)
        if req is None:
            raise InvalidArgumentError(f"request {req_id!r} is not active")
        if req.cursor is None:
            self._stages().extend(req_id, token_ids)
            return
        ptr, n, keep = as_int32_buffer(token_ids)
        if n == 0:
            return
        req.cursor._extend_buffer(ptr, n, keep)  # refuses bad tokens before any change
        seq_id = req.seq_id
        if seq_id is not None and self._cached.get(req_id) == seq_id:
            self._global._append_buffer(seq_id, ptr, n, keep)
            if self._max_tokens is not None or self._max_bytes is not None:
                self._enforce_budget(req_id, req)

    def evict_cached_response(self, req_id: Hashable) -> None:
        """Remove a request's response from the global tree.

        Raises:
            ValueError (InvalidArgumentError): no cached response for that id.
        """
        if req_id not in self._cached:
            raise InvalidArgumentError(f"request {req_id!r} has no cached response")
        self._evict(req_id)

    # --- drafting ------------------------------------------------------------

    def speculate(
        self,
        req_id: Hashable,
        context: TokenArray,
        max_spec_tokens: int | None = None,
        max_spec_factor: float = 1.0,
        max_spec_offset: float = 0.0,
        min_token_prob: float = 0.1,
        use_tree_spec: bool = False,
    ) -> SuffixDecodingDraft:
        """Draft continuations of ``context`` for an active request.

        ``context`` is the request's text so far, usually its last
        ``max_tree_depth`` tokens.  Drafts have at most ``max_spec_tokens``
        tokens (default ``max_tree_depth``; <= 0 gives an empty draft) and at
        most ``max_spec_factor * match_len + max_spec_offset``.

        Raises:
            ValueError (InvalidArgumentError): the request is not active, or a
                parameter is out of range.
            TypeError, InvalidTokenError: bad context tokens.
        """
        req = self._active.get(req_id)
        if req is None:
            raise InvalidArgumentError(f"request {req_id!r} is not active")
        # Fast paths: the very objects of the last call (vLLM passes the same
        # config floats and small ints every step), else arguments of exactly
        # the builtin types seen before (exact types keep 1, 1.0 and True
        # apart as keys).
        last = self._last
        if (
            max_spec_tokens is last[0]
            and max_spec_factor is last[1]
            and max_spec_offset is last[2]
            and min_token_prob is last[3]
            and use_tree_spec is last[4]
        ):
            params = last[5]
        elif (
            type(max_spec_tokens) is int
            and type(max_spec_factor) is float
            and type(max_spec_offset) is float
            and type(min_token_prob) is float
            and type(use_tree_spec) is bool
        ):
            key = (max_spec_tokens, max_spec_factor, max_spec_offset, min_token_prob, use_tree_spec)
            params = self._fast_params.get(key)
        else:
            params = None
        if params is None:
            params = self._checked_params(
                max_spec_tokens, max_spec_factor, max_spec_offset, min_token_prob, use_tree_spec
            )
            if params is None:
                return SuffixDecodingDraft()
        cursor = req.cursor
        if cursor is None:
            return SuffixDecodingDraft.from_native(self._stages().draft(req_id, params))
        return cursor._draft_tail(context, self._draft_global, params, SuffixDecodingDraft)

    # --- internals -----------------------------------------------------------

    def _stages(self) -> Speculator:
        """The stage-shard speculator for staged requests (made on first use)."""
        if self._speculator is None:
            # arctic's behaviour: drafts as the speculate arguments give them
            self._speculator = Speculator(self._max_tree_depth, goodput=False)
        return self._speculator

    def _checked_params(
        self,
        max_spec_tokens: object,
        max_spec_factor: object,
        max_spec_offset: object,
        min_token_prob: object,
        use_tree_spec: object,
    ) -> DraftParams | None:
        """Check `speculate`'s arguments and return their `DraftParams` (None: empty draft)."""
        if max_spec_tokens is None:
            spec = self._default_spec
        else:
            spec = as_int(max_spec_tokens, "max_spec_tokens", expected="an int or None")
            if spec <= 0:
                return None
            spec = min(spec, lowlevel.MAX_SPEC_LIMIT)
        params = self._get_params(
            spec,
            _real(max_spec_factor, "max_spec_factor"),
            _real(max_spec_offset, "max_spec_offset"),
            _real(min_token_prob, "min_token_prob"),
            bool(use_tree_spec),
        )
        args = (max_spec_tokens, max_spec_factor, max_spec_offset, min_token_prob, use_tree_spec)
        if tuple(map(type, args)) == _FAST_TYPES:
            fast = self._fast_params
            if len(fast) >= _PARAMS_CACHE_SIZE:
                fast.clear()
            fast[args] = params
        if all(type(a) in _IMMUTABLE or isinstance(a, np.generic) for a in args):
            # immutable objects: the same objects next time mean the same params
            self._last = (*args, params)
        return params

    def _get_params(
        self, spec: int, factor: float, offset: float, min_prob: float, tree: bool
    ) -> DraftParams:
        """A cached `DraftParams` for these speculate arguments."""
        key = (spec, factor, offset, min_prob, tree)
        params = self._params.get(key)
        if params is None:
            try:
                params = DraftParams(
                    max_spec_tokens=spec,
                    alpha=factor,
                    offset=offset,
                    min_token_prob=min_prob,
                    tree=bool(tree),
                    use_global=self._use_global,
                )
            except InvalidArgumentError as e:  # name the argument as speculate's caller knows it
                message = str(e.args[0])
                for field_name, arg in _ARG_NAMES:
                    if message.startswith(field_name + " "):
                        message = arg + message[len(field_name) :]
                raise InvalidArgumentError(message, *e.args[1:]) from None
            if len(self._params) >= _PARAMS_CACHE_SIZE:
                self._params.clear()
            self._params[key] = params
        return params

    def _evict(self, req_id: Hashable) -> None:
        """Drop a cached response (the request may still be active)."""
        seq_id = self._cached.pop(req_id)
        if seq_id in self._global:
            self._global.remove(seq_id)

    def _enforce_count(self, protect: Hashable) -> None:
        """FIFO-evict beyond max_cached_requests, never ``protect``."""
        limit = self._max_cached_requests
        if limit < 0:
            return
        while len(self._cached) > limit:
            victim = next((r for r in self._cached if r != protect), _NONE)
            if victim is _NONE:
                return
            self._evict(victim)

    def _enforce_budget(self, protect: Hashable, req: _Request) -> None:
        """Evict the oldest cached responses until the global tree fits its budgets."""
        max_tokens, max_bytes = self._max_tokens, self._max_bytes
        while True:
            stats = self._global.stats()
            if (max_tokens is None or stats.tokens <= max_tokens) and (
                max_bytes is None or stats.bytes <= max_bytes
            ):
                return
            victim = next((r for r in self._cached if r != protect), _NONE)
            if victim is _NONE:
                if not req.warned:
                    req.warned = True
                    get_logger().warning(
                        "cached response alone exceeds the cache budget",
                        req_id=repr(protect),
                        tokens=stats.tokens,
                        bytes=stats.bytes,
                        max_cached_tokens=max_tokens,
                        max_cached_bytes=max_bytes,
                    )
                return
            self._evict(victim)

    def __repr__(self) -> str:
        """Short description."""
        return (
            f"<SuffixDecodingCache max_tree_depth={self._max_tree_depth} "
            f"active={len(self._active)} cached={len(self._cached)}>"
        )


_NONE: Any = object()
_IMMUTABLE = (int, float, bool, type(None))
# speculate's argument types whose values can key a dict safely (1, 1.0 and True kept apart)
_FAST_TYPES = (int, float, float, float, bool)
