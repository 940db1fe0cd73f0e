"""Property tests: the native engine against the pure-Python reference model.

Token streams come from small alphabets (with a few huge ids mixed in) and the
depths are small, so repeats, ties and the depth limit are hit constantly.
Every test is derandomized, so a failure reproduces on every run.
"""

from __future__ import annotations

import array
import itertools
from dataclasses import asdict
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from reference import RefDraft, RefParams, RefTree, reference_draft

from agentspec import BatchDrafter, Cursor, Draft, DraftParams, SuffixTree, draft_batch
from agentspec._core import lowlevel

BIG = 2**31 - 1
ALPHABETS = [
    [0, 1],
    [0, 1, 2],
    [0, 1, 2, 3, 4, 5],
    [0, 7, BIG],
    [3, 100_000, BIG - 1, BIG],
]


def _settings(n: int) -> settings:
    return settings(max_examples=n, deadline=None, derandomize=True)


@st.composite
def corpora(
    draw: st.DrawFn, max_seqs: int = 6, max_len: int = 20
) -> tuple[list[int], list[list[int]]]:
    """An alphabet and a list of token sequences over it."""
    alphabet = draw(st.sampled_from(ALPHABETS))
    tok = st.sampled_from(alphabet)
    seqs = draw(st.lists(st.lists(tok, max_size=max_len), min_size=1, max_size=max_seqs))
    return alphabet, seqs


@st.composite
def chunkings(draw: st.DrawFn, seq: list[int]) -> list[list[int]]:
    """Split a sequence into consecutive chunks (some possibly empty)."""
    cuts = sorted(draw(st.lists(st.integers(0, len(seq)), max_size=4)))
    bounds = [0, *cuts, len(seq)]
    return [seq[a:b] for a, b in itertools.pairwise(bounds)]


@st.composite
def params_st(draw: st.DrawFn, depth: int) -> RefParams:
    """Random drafting parameters in the interesting range."""
    max_pattern = draw(st.sampled_from([0, 0, *range(1, depth + 1)]))
    return RefParams(
        max_spec_tokens=draw(st.integers(1, 8)),
        # 0.3*3 + 0.1 and 0.7*7 + 0.1 fall just below an integer: the +1e-6 in B(p) matters.
        alpha=draw(st.sampled_from([0.5, 1.0, 2.0, 3.0, 0.3, 0.7])),
        offset=draw(st.sampled_from([0.0, 1.0, 0.1])),
        min_token_prob=draw(st.sampled_from([0.0, 0.0, 0.1, 0.3])),
        tree=draw(st.booleans()),
        min_score=draw(st.sampled_from([0.0, 0.0, 0.0, 0.5, 1.5])),
        # min_pattern > max_pattern (with max_pattern set) is refused: see test_bad_input.
        min_pattern=draw(st.integers(0, min(3, max_pattern) if max_pattern else 3)),
        max_pattern=max_pattern,
        # a vocabulary bound inside or above the alphabets (None: no bound)
        vocab_size=draw(st.sampled_from([None, None, None, 1, 2, 5, 8, 100_000, BIG])),
    )


def to_params(ref: RefParams, **overrides: Any) -> DraftParams:
    """The DraftParams equal to a RefParams."""
    return DraftParams(**{**asdict(ref), **overrides})


def assert_same_draft(got: Draft, want: RefDraft) -> None:
    """Engine draft == reference draft (float32 probs, double score)."""
    event(f"source={want.source} len={min(len(want.token_ids), 3)}")
    assert got.token_ids == want.token_ids
    assert got.parents == want.parents
    assert got.probs == pytest.approx(want.probs, rel=1e-6, abs=0)
    assert got.score == pytest.approx(want.score, rel=0, abs=1e-9)
    assert got.match_len == want.match_len
    assert got.source == want.source
    assert len(got) == len(want.token_ids)


def assert_same_engine_draft(a: Draft, b: Draft) -> None:
    """Two engine drafts are identical."""
    assert (a.token_ids, a.parents, a.probs, a.score, a.match_len, a.source) == (
        b.token_ids,
        b.parents,
        b.probs,
        b.score,
        b.match_len,
        b.source,
    )


SOURCES = ("none", "global", "local", "merged")  # as_draft_out.source codes 0..3


def draft_context(
    g: SuffixTree | None, loc: SuffixTree | None, context: list[int], params: DraftParams
) -> Draft:
    """as_draft_context(global, local, context) through the raw layer (no cursor state)."""
    bufs = lowlevel.DraftBuffers(params.max_spec_tokens)
    arr = array.array("i", context)
    handles = [lowlevel.NULL if t is None else t._h for t in (g, loc)]
    ptr = lowlevel.int32_ptr(arr)
    lowlevel.draft_context(handles[0], handles[1], ptr, len(arr), arr, params._c, bufs)
    tokens, parents, probs, score, match_len, source = bufs.result()
    return Draft(tokens, parents, probs, score, match_len, SOURCES[source])


def probe_strings(ref: RefTree, alphabet: list[int]) -> dict[tuple[int, ...], int]:
    """Every indexed string, every one-token extension of it, and some absent ones."""
    counts = ref.counts()
    probes = dict(counts)
    for key in [*list(counts), ()]:
        for t in alphabet:
            ext = (*key, t)
            probes.setdefault(ext, counts.get(ext, 0) if len(ext) <= ref.max_depth else 0)
    probes.setdefault((BIG, 0, BIG), counts.get((BIG, 0, BIG), 0) if ref.max_depth >= 3 else 0)
    return probes


def assert_same_counts(tree: SuffixTree, ref: RefTree, alphabet: list[int]) -> None:
    """count() agrees with the reference on all probe strings, and stats agree."""
    for key, want in probe_strings(ref, alphabet).items():
        assert tree.count(list(key)) == want, key
    stats = tree.stats()
    assert stats.sequences == len(ref.seqs) == len(tree)
    assert stats.open_sequences == len(ref.open)
    assert stats.tokens == ref.n_tokens()
    assert stats.max_depth == ref.max_depth == tree.max_depth


def fill(
    tree: SuffixTree, ref: RefTree, seqs: list[list[int]], data: st.DataObject, first_id: int = 0
) -> list[int]:
    """Insert seqs into both trees, each closed via add or open via chunked appends."""
    ids = []
    for i, seq in enumerate(seqs):
        sid = first_id + i * 7919 - 3 * i * i  # spread-out ids
        ids.append(sid)
        if data.draw(st.booleans(), label="closed"):
            tree.add(sid, seq)
            ref.add(sid, seq)
        else:
            for chunk in data.draw(chunkings(seq), label="chunks"):
                tree.append(sid, chunk)
                ref.append(sid, chunk)
            if sid not in ref.seqs:  # all chunks empty: create it anyway
                tree.append(sid, [])
                ref.append(sid, [])
            if data.draw(st.booleans(), label="close"):
                tree.close_sequence(sid)
                ref.close(sid)
    return ids


@st.composite
def contexts(draw: st.DrawFn, alphabet: list[int], seqs: list[list[int]]) -> list[int]:
    """A random context, or one ending in a substring of a stored sequence."""
    tok = st.sampled_from(alphabet)
    prefix = draw(st.lists(tok, max_size=6))
    usable = [s for s in seqs if s]
    from_corpus = draw(st.integers(0, 3)) > 0  # mostly: a suffix-extension of a sequence
    if usable and from_corpus:
        seq = draw(st.sampled_from(usable))
        i = draw(st.integers(0, len(seq) - 1))
        j = draw(st.integers(i + 1, len(seq)))
        return prefix + seq[i:j]
    return prefix + draw(st.lists(tok, max_size=8))


# --- counts -------------------------------------------------------------------


@_settings(150)
@given(depth=st.integers(2, 8), corpus=corpora(), data=st.data())
def test_counts_match_reference(depth: int, corpus: Any, data: st.DataObject) -> None:
    """count() and stats() equal the reference for closed and open sequences."""
    alphabet, seqs = corpus
    with SuffixTree(depth) as tree:
        ref = RefTree(depth)
        fill(tree, ref, seqs, data)
        assert_same_counts(tree, ref, alphabet)
        tree.check()
        assert tree.sequence_ids() == list(ref.seqs)
        for sid, toks in ref.seqs.items():
            assert sid in tree
            assert tree.sequence(sid) == toks


@_settings(100)
@given(depth=st.integers(2, 8), corpus=corpora(max_seqs=8), data=st.data())
def test_removal_matches_reference(depth: int, corpus: Any, data: st.DataObject) -> None:
    """Removing sequences in random order restores exactly their counts."""
    alphabet, seqs = corpus
    with SuffixTree(depth) as tree:
        ref = RefTree(depth)
        ids = fill(tree, ref, seqs, data)
        order = data.draw(st.permutations(ids), label="removal order")
        n_remove = data.draw(st.integers(0, len(order)), label="n_remove")
        for sid in order[:n_remove]:
            tree.remove(sid)
            ref.remove(sid)
            assert sid not in tree
            tree.check()
            assert_same_counts(tree, ref, alphabet)
        # Re-adding the removed sequences (as closed) works and counts agree.
        for sid in order[:n_remove]:
            tree.add(sid, seqs[ids.index(sid)])
            ref.add(sid, seqs[ids.index(sid)])
        tree.check()
        assert_same_counts(tree, ref, alphabet)
        # Removing everything leaves only the root.
        for sid in list(ref.seqs):
            tree.remove(sid)
            ref.remove(sid)
        tree.check()
        assert_same_counts(tree, ref, alphabet)
        stats = tree.stats()
        assert stats.nodes == 1
        assert stats.tokens == 0
        assert len(tree) == 0


# --- drafts from a tree -------------------------------------------------------


@_settings(300)
@given(depth=st.integers(2, 8), corpus=corpora(), data=st.data())
def test_global_draft_matches_reference(depth: int, corpus: Any, data: st.DataObject) -> None:
    """SuffixTree.draft (global tree only) equals the reference draft exactly."""
    alphabet, seqs = corpus
    with SuffixTree(depth) as tree:
        ref = RefTree(depth)
        fill(tree, ref, seqs, data)
        for _ in range(3):
            ctx = data.draw(contexts(alphabet, seqs), label="context")
            rp = data.draw(params_st(depth), label="params")
            got = tree.draft(ctx, to_params(rp))
            assert_same_draft(got, reference_draft(ctx, rp, ref))


@_settings(60)
@given(depth=st.integers(2, 8), corpus=corpora(), data=st.data())
def test_draft_param_overrides(depth: int, corpus: Any, data: st.DataObject) -> None:
    """Keyword overrides on draft() mean the same as a DraftParams."""
    alphabet, seqs = corpus
    with SuffixTree(depth) as tree:
        ref = RefTree(depth)
        fill(tree, ref, seqs, data)
        ctx = data.draw(contexts(alphabet, seqs), label="context")
        rp = data.draw(params_st(depth), label="params")
        got = tree.draft(ctx, **asdict(rp))
        assert_same_draft(got, reference_draft(ctx, rp, ref))


# --- cursors ------------------------------------------------------------------

MODES = [
    {"use_local": True, "use_global": True, "merge": False},
    {"use_local": True, "use_global": False, "merge": False},
    {"use_local": False, "use_global": True, "merge": False},
    {"use_local": True, "use_global": True, "merge": True},
    {"use_local": True, "use_global": False, "merge": True},
    {"use_local": False, "use_global": True, "merge": True},
]


@_settings(150)
@given(depth=st.integers(2, 8), corpus=corpora(), data=st.data())
def test_cursor_draft_matches_reference_while_global_changes(
    depth: int, corpus: Any, data: st.DataObject
) -> None:
    """A cursor fed in chunks drafts like the reference even as the global tree changes."""
    alphabet, seqs = corpus
    tok = st.sampled_from(alphabet)
    with SuffixTree(depth) as tree, Cursor(depth, local_tree=True) as cur:
        ref = RefTree(depth)
        fill(tree, ref, seqs, data)
        next_id = 10**12
        context: list[int] = []
        for _step in range(data.draw(st.integers(1, 8), label="steps")):
            chunk = data.draw(
                st.one_of(st.lists(tok, max_size=6), contexts(alphabet, list(ref.seqs.values()))),
                label="chunk",
            )
            cur.extend(chunk)
            context += chunk
            action = data.draw(st.sampled_from(["add", "append", "remove", "none"]))
            if action == "add":
                new = data.draw(st.lists(tok, max_size=10), label="new seq")
                tree.add(next_id, new)
                ref.add(next_id, new)
                next_id += 1
            elif action == "append" and ref.open:
                sid = data.draw(st.sampled_from(sorted(ref.open)), label="open id")
                more = data.draw(st.lists(tok, max_size=6), label="more")
                tree.append(sid, more)
                ref.append(sid, more)
            elif action == "remove" and ref.seqs:
                sid = data.draw(st.sampled_from(list(ref.seqs)), label="remove id")
                tree.remove(sid)
                ref.remove(sid)
            assert len(cur) == len(context)
            local = RefTree(depth)
            local.add(0, context)
            stats = cur.local_stats()
            assert stats is not None
            assert stats.tokens == len(context)
            rp = data.draw(params_st(depth), label="params")
            mode = data.draw(st.sampled_from(MODES), label="mode")
            rp = RefParams(**{**asdict(rp), **mode})
            with_global = data.draw(st.booleans(), label="pass global")
            g = tree if with_global else None
            want = reference_draft(context, rp, ref if with_global else None, local)
            assert_same_draft(cur.draft(g, to_params(rp)), want)
            # The from-scratch path (as_draft_context with both trees) agrees too.
            with SuffixTree(depth) as loc:
                loc.add(0, context)
                assert_same_draft(draft_context(g, loc, context, to_params(rp)), want)


@st.composite
def repetitive(draw: st.DrawFn, alphabet: list[int], max_len: int) -> list[int]:
    """A sequence made of runs and copies of its own earlier parts (long repeats)."""
    tok = st.sampled_from(alphabet)
    out: list[int] = []
    while len(out) < max_len and draw(st.integers(0, 9)):
        kind = draw(st.integers(0, 2))
        if kind == 0:
            out += [draw(tok)] * draw(st.integers(1, 12))
        elif kind == 1 and out:
            i = draw(st.integers(0, len(out) - 1))
            out += out[i : i + draw(st.integers(1, 16))]
        else:
            out.append(draw(tok))
    return out[:max_len]


@_settings(40)
@given(depth=st.integers(9, 32), alphabet=st.sampled_from(ALPHABETS), data=st.data())
def test_deeper_trees_with_long_repeats(
    depth: int, alphabet: list[int], data: st.DataObject
) -> None:
    """Deeper trees over long, self-repeating sequences: counts and cursor drafts still agree."""
    with SuffixTree(depth) as tree, Cursor(depth) as cur:
        ref = RefTree(depth)
        seqs = data.draw(st.lists(repetitive(alphabet, 80), min_size=1, max_size=4), label="seqs")
        fill(tree, ref, seqs, data)
        assert_same_counts(tree, ref, alphabet)
        context: list[int] = []
        for _step in range(4):
            chunk = data.draw(contexts(alphabet, list(ref.seqs.values())), label="chunk")
            cur.extend(chunk)
            context += chunk
            remove_one = data.draw(st.booleans(), label="remove one")
            if ref.seqs and remove_one:
                sid = data.draw(st.sampled_from(list(ref.seqs)), label="removed")
                tree.remove(sid)
                ref.remove(sid)
            local = RefTree(depth)
            local.add(0, context)
            rp = RefParams(
                **{
                    **asdict(data.draw(params_st(depth), label="params")),
                    "max_spec_tokens": data.draw(st.integers(1, 40), label="max_spec_tokens"),
                    **data.draw(st.sampled_from(MODES), label="mode"),
                }
            )
            want = reference_draft(context, rp, ref, local)
            assert_same_draft(cur.draft(tree, to_params(rp)), want)
        tree.check()
        assert_same_counts(tree, ref, alphabet)


@_settings(100)
@given(dg=st.integers(2, 8), dc=st.integers(2, 8), corpus=corpora(), data=st.data())
def test_cursor_and_tree_of_different_depths(
    dg: int, dc: int, corpus: Any, data: st.DataObject
) -> None:
    """A cursor of depth dc bounds patterns to dc-1 in both trees; trees bound their drafts."""
    alphabet, seqs = corpus
    with SuffixTree(dg) as tree, Cursor(dc) as cur:
        ref = RefTree(dg)
        fill(tree, ref, seqs, data)
        context: list[int] = []
        for chunk in data.draw(chunkings(data.draw(contexts(alphabet, seqs))), label="chunks"):
            cur.extend(chunk)
            context += chunk
            local = RefTree(dc)
            local.add(0, context)
            rp = data.draw(params_st(max(dg, dc)), label="params")
            rp = RefParams(**{**asdict(rp), **data.draw(st.sampled_from(MODES), label="mode")})
            want = reference_draft(context, rp, ref, local, cursor_depth=dc)
            assert_same_draft(cur.draft(tree, to_params(rp)), want)


@_settings(60)
@given(depth=st.integers(2, 8), corpus=corpora(), data=st.data())
def test_cursor_without_local_tree(depth: int, corpus: Any, data: st.DataObject) -> None:
    """A cursor without a local tree drafts from the global tree only."""
    alphabet, seqs = corpus
    with SuffixTree(depth) as tree, Cursor(depth, local_tree=False) as cur:
        ref = RefTree(depth)
        fill(tree, ref, seqs, data)
        assert cur.local_stats() is None
        context: list[int] = []
        for chunk in data.draw(chunkings(data.draw(contexts(alphabet, seqs))), label="chunks"):
            cur.extend(chunk)
            context += chunk
            rp = data.draw(params_st(depth), label="params")
            assert_same_draft(cur.draft(tree, to_params(rp)), reference_draft(context, rp, ref))


@_settings(60)
@given(depth=st.integers(2, 8), corpus=corpora(), data=st.data())
def test_cursor_prompt_equals_extend(depth: int, corpus: Any, data: st.DataObject) -> None:
    """Cursor(prompt=...) is the same as extending an empty cursor."""
    alphabet, seqs = corpus
    with SuffixTree(depth) as tree:
        ref = RefTree(depth)
        fill(tree, ref, seqs, data)
        ctx = data.draw(contexts(alphabet, seqs), label="context")
        rp = data.draw(params_st(depth), label="params")
        with Cursor(depth, prompt=ctx) as cur:
            local = RefTree(depth)
            local.add(0, ctx)
            assert_same_draft(cur.draft(tree, to_params(rp)), reference_draft(ctx, rp, ref, local))


# --- batches ------------------------------------------------------------------


@_settings(60)
@given(depth=st.integers(2, 8), corpus=corpora(), data=st.data())
def test_batch_equals_per_cursor(depth: int, corpus: Any, data: st.DataObject) -> None:
    """BatchDrafter and draft_batch (1 and 2 threads) equal per-cursor drafting."""
    alphabet, seqs = corpus
    tok = st.sampled_from(alphabet)
    threads = data.draw(st.sampled_from([1, 2]), label="threads")
    rp = data.draw(params_st(depth), label="params")
    rp = RefParams(**{**asdict(rp), **data.draw(st.sampled_from(MODES), label="mode")})
    params = to_params(rp)
    n = data.draw(st.integers(1, 5), label="items")
    with SuffixTree(depth) as tree:
        ref = RefTree(depth)
        fill(tree, ref, seqs, data)
        solo = [Cursor(depth, local_tree=data.draw(st.booleans())) for _ in range(n)]
        batch = [Cursor(depth, local_tree=c.local_stats() is not None) for c in solo]
        one_shot = [Cursor(depth, local_tree=c.local_stats() is not None) for c in solo]
        globals_ = [tree if data.draw(st.booleans(), label="global?") else None for _ in range(n)]
        drafter = BatchDrafter(params, max_batch=8, threads=threads)
        try:
            for _step in range(3):
                new = [data.draw(st.one_of(st.none(), st.lists(tok, max_size=5))) for _ in range(n)]
                want = []
                for cur, g, toks in zip(solo, globals_, new, strict=True):
                    if toks is not None:
                        cur.extend(toks)
                    want.append(cur.draft(g, params))
                got = drafter.draft(list(zip(batch, globals_, new, strict=True)))
                got2 = draft_batch(
                    list(zip(one_shot, globals_, new, strict=True)), params, threads=threads
                )
                assert len(got) == len(got2) == n
                for a, b, c in zip(want, got, got2, strict=True):
                    assert_same_engine_draft(a, b)
                    assert_same_engine_draft(a, c)
        finally:
            for cur in solo + batch + one_shot:
                cur.close()


# --- shards -------------------------------------------------------------------


@_settings(100)
@given(depth=st.integers(2, 8), corpus=corpora(), data=st.data())
def test_snapshot_round_trip(depth: int, corpus: Any, data: st.DataObject) -> None:
    """from_bytes(to_bytes()) has the same sequences, counts and drafts."""
    alphabet, seqs = corpus
    with SuffixTree(depth) as tree:
        ref = RefTree(depth)
        fill(tree, ref, seqs, data)
        blob = tree.to_bytes()
        loaded = SuffixTree(depth)
        loaded.load(blob)  # a snapshot loads into an empty tree too
        for sid in list(ref.open):
            ref.close(sid)  # snapshots load closed
        for copy in (SuffixTree.from_bytes(blob), loaded):
            with copy:
                assert copy.sequence_ids() == tree.sequence_ids()
                assert_same_counts(copy, ref, alphabet)
                copy.check()
                for _ in range(2):
                    ctx = data.draw(contexts(alphabet, seqs), label="context")
                    params = to_params(data.draw(params_st(depth), label="params"))
                    assert_same_engine_draft(copy.draft(ctx, params), tree.draft(ctx, params))


@_settings(100)
@given(depth=st.integers(2, 8), corpus=corpora(), more=corpora(), data=st.data())
def test_delta_reproduces_tree(depth: int, corpus: Any, more: Any, data: st.DataObject) -> None:
    """A delta (added, grown and removed sequences) applied to a copy reproduces the tree."""
    alphabet, seqs = corpus
    tok = st.sampled_from(alphabet)
    with SuffixTree(depth) as tree:
        ref = RefTree(depth)
        ids = fill(tree, ref, seqs, data)
        copy = SuffixTree.from_bytes(tree.to_bytes())
        with copy:
            removed = (
                data.draw(st.lists(st.sampled_from(ids), unique=True), label="removed")
                if ids
                else []
            )
            for sid in removed:
                tree.remove(sid)
                ref.remove(sid)
            grown = [sid for sid in ref.open if data.draw(st.booleans(), label="grow")]
            for sid in grown:
                extra = data.draw(st.lists(tok, min_size=1, max_size=5), label="extra")
                tree.append(sid, extra)
                ref.append(sid, extra)
            added = fill(tree, ref, [[t % 5 for t in s] for s in more[1]], data, first_id=-(10**15))
            delta = tree.delta_bytes(added + grown, removed + grown)
            copy.load(delta)
            for sid in list(ref.open):
                ref.close(sid)
            assert_same_counts(copy, ref, [*alphabet, 0, 1, 2, 3, 4])
            copy.check()
            copy.load(delta)  # applying the same delta again changes nothing
            assert_same_counts(copy, ref, [*alphabet, 0, 1, 2, 3, 4])
            assert sorted(copy.sequence_ids()) == sorted(ref.seqs)
