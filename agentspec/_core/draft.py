"""Drafts: `DraftParams`, `Draft`, and the buffers the engine writes drafts into."""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, TypeVar

from agentspec._core import lowlevel
from agentspec._util.args import as_int
from agentspec.exceptions import InvalidArgumentError

__all__ = ["Draft", "DraftParams", "confidence_table"]

T = TypeVar("T")

#: Draft.source for the C ``source`` codes 0..3.
SOURCES = ("none", "global", "local", "merged")

#: ``(tokens, parents, probs, score, match_len, source code)`` as read from C.
DraftResult = tuple[list[int], list[int], list[float], float, int, int]

_UINT32_MAX = 2**32 - 1
#: Largest vocab_size: token ids are int32 values >= 0, so 2**31 bounds nothing.
_VOCAB_MAX = 2**31


def check_max_depth(max_depth: object, name: str = "max_depth") -> int:
    """Validate a tree/cursor depth: an int in [2, AS_MAX_DEPTH_LIMIT], as a plain int."""
    return as_int(max_depth, name, 2, lowlevel.MAX_DEPTH_LIMIT)


def _check_float(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, not {type(value).__name__}")
    if not math.isfinite(value):
        raise InvalidArgumentError(f"{name} must be finite", f"got {value}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, not {type(value).__name__}")


def _bin_middle(b: int) -> float:
    """The middle of confidence bin ``b`` (bit length b: [2**(b-1), 2**b - 1]; 0 and 1 -> 1)."""
    return 1.0 if b <= 1 else 1.5 * 2 ** (b - 1) - 0.5


def confidence_table(
    scale: float = 0.5, length_exp: float = 1.0, count_exp: float = 0.5
) -> tuple[float, ...]:
    """A confidence table for `DraftParams.conf` from a two-exponent model.

    A token continuing ``L`` matched tokens (the pattern plus the tokens drafted
    before it) whose string occurred ``T`` times is accepted with probability
    ``1 - 1 / (1 + scale * L**length_exp * T**count_exp)``, evaluated at the
    middle of each bin.  The defaults were fitted to the acceptance measured on
    text-to-SQL, agent and code-edit traces (docs/benchmarks.md, "Confidence
    drafting"): one token after a single one-token match is a coin flip at
    best, a 16-token match seen 4 times is right about 19 times in 20.
    """
    for name, v in (("scale", scale), ("length_exp", length_exp), ("count_exp", count_exp)):
        _check_float(name, v)
        if v < 0:
            raise InvalidArgumentError(f"{name} must be >= 0", f"got {v}")
    n = lowlevel.CONF_BINS
    out = []
    for lb in range(n):
        for tb in range(n):
            x = scale * _bin_middle(lb) ** length_exp * _bin_middle(tb) ** count_exp
            out.append(1.0 - 1.0 / (1.0 + x))
    return tuple(out)


def check_conf(conf: object) -> tuple[float, ...]:
    """A confidence table as a tuple of `lowlevel.CONF_BINS` ** 2 floats in [0, 1]."""
    n = lowlevel.CONF_BINS**2
    if not isinstance(conf, Iterable) or isinstance(conf, (str, bytes)):
        raise TypeError(f"conf must be a sequence of {n} floats, not {type(conf).__name__}")
    values: tuple[Any, ...] = tuple(conf)
    if len(values) != n:
        raise InvalidArgumentError(f"conf must hold {n} values", f"got {len(values)}")
    for v in values:
        _check_float("conf values", v)
        if not 0.0 <= v <= 1.0:
            raise InvalidArgumentError("conf values must be in [0, 1]", f"got {v}")
    return tuple(float(v) for v in values)


@dataclass(frozen=True)
class DraftParams:
    """How drafts are built (see docs/design-native.md for the exact semantics).

    Attributes:
        max_spec_tokens: most tokens in one draft, 1..AS_MAX_SPEC_LIMIT (1024).
        alpha: draft budget per matched token (>= 0): a match of length p
            drafts at most ``floor(alpha*p + offset)`` tokens.
        offset: constant part of that budget.
        min_token_prob: tokens whose path probability falls below this are
            not drafted; in [0, 1].
        tree: best-first tree drafts instead of a single chain.
        merge: add the counts of the global and per-request trees per string
            instead of drafting from each and keeping the better.
        use_local: draft from the per-request tree of a Cursor.
        use_global: draft from the global tree.
        min_score: drafts scoring below this are returned empty.
        max_pattern: longest pattern (context suffix) tried; 0 = max_depth-1.
        min_pattern: shortest pattern tried; 0 = 1.
        vocab_size: the model's vocabulary size, or None (no bound).  A
            token id >= vocab_size ends its branch: a chain stops before it,
            a tree draft leaves it (and everything below it) out; the other
            tokens keep their probabilities.  Shards learned from another
            model's tokenizer then never put unverifiable ids in a draft.
        conf: a confidence table (`confidence_table`), or None.  With one,
            each token's probability is also multiplied by the table's
            acceptance rate for its matched length and count, so drafts
            stop where the evidence thins instead of at ``alpha * p``;
            `DraftParams.confident` gives the default policy.

    Instances are immutable and cache their C struct, so reusing one instance
    across calls is the cheap way to draft.
    """

    max_spec_tokens: int = 32
    alpha: float = 1.0
    offset: float = 0.0
    min_token_prob: float = 0.1
    tree: bool = False
    merge: bool = False
    use_local: bool = True
    use_global: bool = True
    min_score: float = 0.0
    max_pattern: int = 0
    min_pattern: int = 0
    vocab_size: int | None = None
    conf: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        """Validate every field; bad values raise TypeError or InvalidArgumentError."""
        # Integer fields may be any integral type (numpy scalars included):
        # stored as plain ints, so equal params hash alike and C gets ints.
        for name, lo, hi in (
            ("max_spec_tokens", 1, lowlevel.MAX_SPEC_LIMIT),
            ("max_pattern", 0, _UINT32_MAX),
            ("min_pattern", 0, _UINT32_MAX),
        ):
            value = getattr(self, name)
            if type(value) is not int or not lo <= value <= hi:
                object.__setattr__(self, name, as_int(value, name, lo, hi))
        if self.vocab_size is not None and (
            type(self.vocab_size) is not int or not 1 <= self.vocab_size <= _VOCAB_MAX
        ):
            object.__setattr__(
                self,
                "vocab_size",
                as_int(self.vocab_size, "vocab_size", 1, _VOCAB_MAX, expected="an int or None"),
            )
        _check_float("alpha", self.alpha)
        if self.alpha < 0:
            raise InvalidArgumentError("alpha must be >= 0", f"got {self.alpha}")
        _check_float("offset", self.offset)
        _check_float("min_token_prob", self.min_token_prob)
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise InvalidArgumentError(
                "min_token_prob must be in [0, 1]", f"got {self.min_token_prob}"
            )
        _check_float("min_score", self.min_score)
        if self.max_pattern != 0 and self.min_pattern > self.max_pattern:
            raise InvalidArgumentError(
                "min_pattern must not exceed max_pattern",
                f"got {self.min_pattern} > {self.max_pattern}",
            )
        for name in ("tree", "merge", "use_local", "use_global"):
            _check_bool(name, getattr(self, name))
        if self.conf is not None:
            object.__setattr__(self, "conf", check_conf(self.conf))

    @classmethod
    def confident(cls, **overrides: Any) -> DraftParams:
        """The confidence policy, the default of `Speculator` and the engines.

        Every token is weighed by `confidence_table()` and a draft stops
        once its path probability falls below ``min_token_prob`` (0.25); the
        match-length budget is lifted (``alpha`` = 32).  ``overrides`` replace
        any field.  At equal drafted tokens per step it accepts more than the
        count-only policy of `DraftParams()` (docs/benchmarks.md).
        """
        base: dict[str, Any] = {
            "alpha": CONFIDENT_ALPHA,
            "min_token_prob": CONFIDENT_MIN_PROB,
            "conf": DEFAULT_CONF,
        }
        base.update(overrides)
        return cls(**base)

    def __getstate__(self) -> dict[str, Any]:
        """Pickle/copy the fields only, never the cached C struct."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @cached_property
    def _c(self) -> lowlevel.CData:
        """The ``as_draft_params`` struct, built once per instance."""
        flags = (
            (lowlevel.DRAFT_TREE if self.tree else 0)
            | (lowlevel.DRAFT_MERGE if self.merge else 0)
            | (0 if self.use_local else lowlevel.DRAFT_NO_LOCAL)
            | (0 if self.use_global else lowlevel.DRAFT_NO_GLOBAL)
        )
        return lowlevel.new_params(
            self.max_spec_tokens,
            self.max_pattern,
            self.min_pattern,
            flags,
            float(self.alpha),
            float(self.offset),
            float(self.min_token_prob),
            float(self.min_score),
            self.vocab_size or 0,
            self.conf,
        )


DEFAULT_PARAMS = DraftParams()

#: The confidence policy's table, cut and budget factor (`DraftParams.confident`).
DEFAULT_CONF: tuple[float, ...] = confidence_table()
CONFIDENT_MIN_PROB = 0.25
CONFIDENT_ALPHA = 32.0


def resolve_params(params: DraftParams | None, overrides: dict[str, Any]) -> DraftParams:
    """``params`` (default `DraftParams()`) with keyword ``overrides`` applied."""
    if params is None:
        return DraftParams(**overrides) if overrides else DEFAULT_PARAMS
    if not isinstance(params, DraftParams):
        raise TypeError(f"params must be a DraftParams, not {type(params).__name__}")
    return dataclasses.replace(params, **overrides) if overrides else params


@dataclass(frozen=True, slots=True)
class Draft:
    """One draft: tokens to verify next, as a chain or a tree.

    Attributes:
        token_ids: the drafted tokens.
        parents: for each token, the index of its parent token in this draft,
            or -1 when it follows the context directly; a chain has
            ``[-1, 0, 1, ...]``.
        probs: each token's estimated probability of being accepted (the
            product of the branch frequencies along its path).
        score: the sum of ``probs``, the expected number of accepted tokens.
        match_len: length of the context suffix the draft continues (0: none).
        source: which tree the draft came from: "none", "global", "local"
            (the per-request tree) or "merged".
    """

    token_ids: list[int]
    parents: list[int]
    probs: list[float]
    score: float
    match_len: int
    source: str

    def __len__(self) -> int:
        """Number of drafted tokens."""
        return len(self.token_ids)


_DRAFT_SLOTS = tuple(
    getattr(Draft, f.name).__set__ for f in dataclasses.fields(Draft)
)  # slot setters: build frozen drafts without frozen __setattr__'s per-field cost


def make_draft(result: tuple[Any, ...]) -> Draft:
    """A `Draft` from a raw ``(tokens, parents, probs, score, match_len, source,
    ...)`` row (further fields, e.g. a global tree index, are ignored).

    Equivalent to ``Draft(*result[:5], SOURCES[result[5]])``, about 3x cheaper:
    drafting is on the decode step's critical path.
    """
    d = object.__new__(Draft)
    s = _DRAFT_SLOTS
    s[0](d, result[0])
    s[1](d, result[1])
    s[2](d, result[2])
    s[3](d, result[3])
    s[4](d, result[4])
    s[5](d, SOURCES[result[5]])
    return d


def draft_from_buffers(bufs: lowlevel.DraftBuffers) -> Draft:
    """Convert the C output in ``bufs`` to a `Draft`."""
    return make_draft(bufs.result())


_tls = threading.local()


def thread_buffers(cap: int) -> lowlevel.DraftBuffers:
    """Output buffers private to the calling thread, with room for ``cap`` tokens."""
    bufs: lowlevel.DraftBuffers | None = getattr(_tls, "bufs", None)
    if bufs is None:
        bufs = _tls.bufs = lowlevel.DraftBuffers(max(cap, DEFAULT_PARAMS.max_spec_tokens))
    elif cap > bufs.cap:
        bufs.ensure(cap)
    return bufs
