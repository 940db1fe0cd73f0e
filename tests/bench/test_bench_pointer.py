"""Tests of `agentspec.bench.pointer.CopyPointer` and the ``copy-pointer`` replay method."""

from __future__ import annotations

import random

import numpy as np
import pytest

from agentspec.bench._methods import CopyPointerMethod, ReplayConfig
from agentspec.bench._trace import Request
from agentspec.bench.pointer import CopyPointer


def test_pointer_follows_the_copy_it_acquired():
    """Two earlier copies share a 3-gram; the pointer follows the more recent one."""
    p = CopyPointer(n=3)
    p.begin([1, 2, 3, 10, 11, 12])
    p.begin([1, 2, 3, 20, 21, 22])
    p.begin([7, 1, 2, 3])
    assert p.propose(3) == [20, 21, 22]
    p.observe([20])
    assert p.streak == 1
    assert p.propose(5) == [21, 22]


def test_pointer_reacquires_after_a_divergence():
    """A token the copy does not have drops it; the next n-gram finds another."""
    p = CopyPointer(n=2)
    p.begin([5, 6, 7, 8, 9])
    p.begin([1, 2, 40, 41, 42])
    p.begin([1, 2])
    assert p.propose(2) == [40, 41]
    p.observe([5, 6])  # not what followed [1, 2] there; [5, 6] is followed by 7
    assert p.streak == 0
    assert p.propose(3) == [7, 8, 9]


def test_pointer_never_proposes_the_context_end_itself():
    """The context's own last n-gram has nothing after it: no proposal."""
    p = CopyPointer(n=2)
    p.begin([3, 4, 5])
    assert p.propose(4) == []
    p.observe([3, 4])  # [3, 4] occurred at the start: 5 followed it
    assert p.propose(4) == [5, 3, 4]


def test_pointer_matches_a_brute_force_model():
    """Random sources: a proposal always continues an earlier occurrence of the
    context's last n tokens, and a fresh pointer finds one whenever one exists."""
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 3)
        p = CopyPointer(n=n)
        for _ in range(rng.randint(1, 4)):
            p.begin([rng.randrange(4) for _ in range(rng.randint(0, 12))])
        for _ in range(6):
            p.observe([rng.randrange(4) for _ in range(rng.randint(1, 3))])
            sources = p._sources
            ctx = sources[p._cur]
            tail = ctx[-n:]
            got = p.propose(4)
            occurrences = [
                (sid, end)
                for sid, src in enumerate(sources)
                for end in range(n, len(src))
                if src[end - n : end] == tail and (sid != p._cur or end < len(ctx))
            ]
            if got:
                assert any(sources[sid][end : end + len(got)] == got for sid, end in occurrences)
            elif p.streak == 0:
                assert len(ctx) < n or not occurrences
    with pytest.raises(ValueError, match="n must be"):
        CopyPointer(n=0)


def _request(i: int, prompt: list[int], response: list[int]) -> Request:
    ctx = np.asarray(prompt, dtype=np.int32)
    return Request(
        index=i,
        session=i,
        workload="w",
        stage="s",
        context=ctx,
        prompt_len=len(prompt),
        generation_prompt=np.zeros(0, dtype=np.int32),
        response=np.asarray(response, dtype=np.int32),
    )


def test_copy_pointer_method_keeps_the_speculators_length():
    """The method's drafts have the confidence speculator's lengths."""
    cfg = ReplayConfig(depth=16, max_spec_tokens=8)
    m = CopyPointerMethod("copy-pointer", cfg, min_streak=0)
    body = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    m.warmup([_request(0, [1, 2], body), _request(1, [1, 2], body)])
    m.start(2, _request(2, [1, 2, *body[:4]], body), np.asarray([1, 2, *body[:4]], np.int32))
    toks, parents, _ = m.draft(0)
    assert parents is None or len(parents) == len(toks)
    assert list(toks) == body[4 : 4 + len(toks)]
    m.extend(list(toks[:2]))
    m.finish()
    m.close()
