"""Speculative verification on the real SmolLM2-135M model, and the sampling rule.

Greedy decoding with drafts (chains, trees, a learning Speculator, adversarial
drafts) must reproduce plain greedy decoding token for token; the sampling
rule is checked exactly (branch probabilities) and statistically.
"""

from __future__ import annotations

import functools
import math
import random

import numpy as np
import pytest
from prereq import require_module

torch = require_module("torch")
require_module("transformers")

from agentspec import Speculator  # noqa: E402
from agentspec.engine import (  # noqa: E402
    DraftTree,
    SamplingParams,
    Verifier,
    accept_sampling,
    as_draft_tree,
    branch_probabilities,
    generate_greedy,
    speculator_drafter,
    target_probs,
)
from agentspec.exceptions import InvalidArgumentError, InvalidTokenError  # noqa: E402

PROMPTS = [
    "List three colors of the rainbow.",
    "Write a Python function that returns the square of a number.",
    "What is the capital of France? Answer in one word.",
    "Translate 'good morning' into Spanish.",
    "Give me a JSON object with keys name and age for a person called Ann who is 30.",
    "Count from 1 to 10, separated by commas.",
    "Explain in one sentence what a suffix tree is.",
    "Write a SQL query that selects all rows from a table named users.",
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def verifier(model_tok):
    return Verifier(model_tok[0])


@pytest.fixture(scope="module")
def eos(model_tok):
    return [model_tok[1].eos_token_id]


@pytest.fixture(scope="module")
def prompts(model_tok):
    tok = model_tok[1]
    out = []
    for text in PROMPTS:
        enc = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        out.append(list(enc["input_ids"]))
    return out


@pytest.fixture(scope="module")
def reference(verifier, prompts, eos):
    """Plain greedy decoding (no drafts) of every prompt."""
    refs = []
    for ids in prompts:
        res = generate_greedy(verifier, ids, MAX_NEW, eos)
        assert res.forward_passes == len(res.tokens)  # one token per forward pass
        refs.append(res.tokens)
    return refs


def oracle(prompt, ref, k=8):
    """Drafts the true continuation, k tokens."""
    full = list(prompt) + list(ref)

    def draft(ctx):
        return full[len(ctx) : len(ctx) + k]

    return draft


def check_same(verifier, prompt, ref, eos, drafter):
    res = generate_greedy(verifier, prompt, MAX_NEW, eos, drafter=drafter)
    assert res.tokens == ref
    committed = verifier.tokens  # may run past an eos inside the last accepted draft
    assert committed[: len(prompt) + len(ref)] == prompt + ref
    assert verifier.cache_len == len(committed) - 1  # the cache: all but the pending token
    return res


# --- greedy losslessness -------------------------------------------------------


def test_plain_greedy_matches_transformers_generate(model_tok, prompts, reference):
    model, tok = model_tok
    for i in (4,):
        ids = torch.tensor([prompts[i]])
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id,
            )
        assert out[0, ids.shape[1] :].tolist() == reference[i]


def test_references_are_varied(reference, eos):
    assert len({tuple(r) for r in reference}) == len(PROMPTS)
    assert any(r[-1] in eos for r in reference)  # some replies stop at eos
    assert any(len(r) == MAX_NEW for r in reference)  # some hit the length limit


def test_oracle_chain_drafts(verifier, prompts, reference, eos):
    for prompt, ref in zip(prompts, reference, strict=True):
        res = check_same(verifier, prompt, ref, eos, oracle(prompt, ref))
        assert res.forward_passes == math.ceil(len(ref) / 9)  # 8 accepted + 1 bonus per pass


@pytest.mark.parametrize("k", [0, 1, 3])
def test_chain_wrong_at_position_k(verifier, prompts, reference, eos, k):
    for i in ((3 * k) % 8,):
        prompt, ref = prompts[i], reference[i]
        full = prompt + ref

        def draft(ctx, full=full):
            d = full[len(ctx) : len(ctx) + 6]
            if len(d) > k:
                d[k] = (d[k] + 1) % 49152
            return d

        res = check_same(verifier, prompt, ref, eos, draft)
        for s in res.steps[:-1]:
            if s.draft_len > k:
                assert s.accepted == k


def test_random_chain_and_tree_drafts(verifier, prompts, reference, eos):
    rng = random.Random(7)

    def chain(ctx):
        return [rng.randrange(49152) for _ in range(rng.randrange(0, 7))]

    def tree(ctx):
        return [rng.randrange(49152) for _ in range(6)], [-1, 0, -1, 2, 3, 0]

    check_same(verifier, prompts[1], reference[1], eos, chain)
    check_same(verifier, prompts[2], reference[2], eos, tree)


def test_tree_drafts_right_path_not_first(verifier, prompts, reference, eos):
    """Wrong siblings first at depth 1 and 2: accepted nodes are re-indexed in the cache."""
    for i in (3, 5, 7):
        prompt, ref = prompts[i], reference[i]
        full = prompt + ref

        def draft(ctx, full=full):
            d = full[len(ctx) : len(ctx) + 4]
            if len(d) < 2:
                return d
            w = [(t + 11) % 49152 for t in d]
            # 0: wrong root, 1: its child; 2: right root d0; 3: wrong child of 2;
            # 4: right child d1 of 2, 5..: the rest of the right chain.
            tokens = [w[0], d[1], d[0], w[1], d[1], *d[2:]]
            parents = [-1, 0, -1, 2, 2, *range(4, 4 + len(d) - 2)]
            return tokens, parents

        res = check_same(verifier, prompt, ref, eos, draft)
        assert max(s.accepted for s in res.steps) >= 3


def test_speculator_learning_as_it_goes(verifier, prompts, reference, eos):
    spec = Speculator(max_depth=32)
    for rnd, tree in ((0, False), (1, True)):
        accepted = 0
        for i, (prompt, ref) in enumerate(zip(prompts, reference, strict=True)):
            if rnd == 1 and i % 2:
                continue  # the second round: half the prompts is enough
            req = (rnd, i)
            spec.start_request(req, prompt, stage="chat")
            drafter = speculator_drafter(spec, req, tree=tree, max_spec_tokens=12)
            res = check_same(verifier, prompt, ref, eos, drafter)
            drafter.sync(prompt + res.tokens)  # the last step's tokens, before learning
            spec.finish(req)
            accepted += res.accepted
        if rnd == 1:  # the second round drafts what the first one learned
            assert accepted >= sum(len(r) for r in reference[::2]) // 2


def test_eos_stops_and_max_new_tokens(verifier, prompts, reference, eos):
    i = next(j for j, r in enumerate(reference) if r[-1] in eos)
    prompt, ref = prompts[i], reference[i]
    # Drafts running past eos: the output still ends at the eos token.
    res = generate_greedy(verifier, prompt, MAX_NEW, eos, drafter=oracle(prompt, [*ref, 5, 6, 7]))
    assert res.tokens == ref
    assert res.finish_reason == "stop"
    # Without eos ids, decoding continues past it.
    res = generate_greedy(verifier, prompt, len(ref) + 3, (), drafter=oracle(prompt, ref))
    assert res.tokens[: len(ref)] == ref
    assert len(res.tokens) == len(ref) + 3
    assert res.finish_reason == "length"
    # max_new_tokens cuts a long accepted draft.
    j = next(j for j, r in enumerate(reference) if len(r) == MAX_NEW)
    for limit in (0, 1, 5):
        res = generate_greedy(
            verifier, prompts[j], limit, eos, drafter=oracle(prompts[j], reference[j], 16)
        )
        assert res.tokens == reference[j][:limit]
        assert res.finish_reason == "length"
    with pytest.raises(InvalidArgumentError):
        generate_greedy(verifier, prompts[j], -1, eos)


def test_cache_matches_fresh_prefill_after_tree_sampling(model_tok, prompts):
    """After sampled tree steps (re-indexed cache), the next logits equal a fresh prefill's."""
    v = Verifier(model_tok[0])
    v.prefill(prompts[0])
    rng = np.random.default_rng(3)
    sampling = SamplingParams(temperature=0.8, top_p=0.95)
    for _ in range(6):
        logits = v.forward_tree(DraftTree((), ()))
        v.discard(DraftTree((), ()))  # forget that pass: it only helps build a draft
        top = torch.topk(logits[0], 3).indices.tolist()
        v.step(([top[1], top[0], top[2], 100], [-1, -1, -1, 1]), sampling=sampling, rng=rng)
    assert v.cache_len == len(v.tokens) - 1
    fresh = Verifier(model_tok[0])
    fresh.prefill(v.tokens)
    a = v.forward_tree(DraftTree((), ()))[0]
    b = fresh.forward_tree(DraftTree((), ()))[0]
    assert torch.allclose(a, b, atol=1e-3, rtol=1e-3)


def test_bad_input(model_tok, verifier):
    fresh = Verifier(model_tok[0])
    with pytest.raises(InvalidArgumentError, match="prefill"):
        fresh.step([1, 2])
    with pytest.raises(InvalidArgumentError):
        fresh.prefill([])
    with pytest.raises(TypeError):
        fresh.prefill("hello")
    with pytest.raises(InvalidTokenError):
        fresh.prefill([1, 49152])
    verifier.prefill([1, 2, 3])
    before = verifier.tokens
    with pytest.raises(InvalidTokenError):
        verifier.step([5, -1])
    with pytest.raises(InvalidArgumentError):
        verifier.step(([5, 6], [-1, 1]))  # a node cannot be its own parent
    with pytest.raises(InvalidArgumentError):
        verifier.step(([5, 6], [-1]))
    assert verifier.tokens == before  # nothing committed
    assert verifier.cache_len == len(before) - 1


# --- draft trees ---------------------------------------------------------------


def test_draft_tree_shapes():
    t = as_draft_tree(([1, 2, 3, 4], [-1, 0, -1, 2]))
    assert t.depths == (1, 2, 1, 2)
    assert t.children == ((0, 2), (1,), (), (3,), ())
    assert not t.is_chain
    assert as_draft_tree([7, 8, 9]).is_chain
    assert t.ancestors().tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [False, False, True, False],
        [False, False, True, True],
    ]
    assert t.trimmed(1) == as_draft_tree(([1, 3], [-1, -1]))
    assert len(as_draft_tree(None)) == 0
    with pytest.raises(TypeError):
        as_draft_tree("abc")


# --- the sampling rule ---------------------------------------------------------


def test_branch_probabilities_reproduce_the_target_exactly():
    rng = np.random.default_rng(0)
    cases = [[2], [2, 0], [1, 1], [4, 3, 2, 1, 0], [0, 3]]
    for _ in range(200):
        p = rng.dirichlet(np.full(5, 0.5))
        if rng.random() < 0.3:
            p[rng.integers(5)] = 0.0
            p /= p.sum()
        cands = cases[int(rng.integers(len(cases)))]
        branch, residual = branch_probabilities(p, cands)
        induced = branch[-1] * residual
        for b, x in zip(branch[:-1], cands, strict=True):
            induced[x] += b
        np.testing.assert_allclose(induced, p, atol=1e-12)
        assert branch.sum() == pytest.approx(1.0)
        assert (branch >= 0).all()
        # the first candidate is accepted with probability p(x)
        assert branch[0] == pytest.approx(p[cands[0]])


def test_target_probs_temperature_and_top_p():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    np.testing.assert_allclose(target_probs(logits), [[0.5, 0.3, 0.15, 0.05]])
    np.testing.assert_array_equal(target_probs(logits, 0.0), [[1, 0, 0, 0]])
    np.testing.assert_allclose(target_probs(logits, 1.0, 0.75), [[0.625, 0.375, 0, 0]])
    np.testing.assert_allclose(
        target_probs(logits, 1.0, 0.81), [[0.5, 0.3, 0.15, 0]] / np.float64(0.95)
    )
    with pytest.raises(InvalidArgumentError):
        target_probs(logits, -1.0)
    with pytest.raises(InvalidArgumentError):
        target_probs(logits, 1.0, 0.0)


@functools.cache
def _cond(prefix):
    """A fixed synthetic next-token distribution over 5 tokens for each prefix."""
    seed = 1 + sum((t + 1) * 6**i for i, t in enumerate(prefix))
    return np.random.default_rng(seed).dirichlet(np.ones(5))


def test_sampled_outputs_follow_the_target():
    """Decode 3 tokens with random tree drafts; compare with the exact law (chi-square)."""
    rng = np.random.default_rng(1234)
    shape = [-1, 0, -1, 2, 3, 2]
    n_samples = 12000
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(n_samples):
        out: list[int] = []
        while len(out) < 3:
            tokens = [int(t) for t in rng.integers(0, 5, len(shape))]
            rows = [_cond(tuple(out))]
            paths: list[list[int]] = []
            for i, par in enumerate(shape):
                paths.append(([] if par < 0 else paths[par]) + [tokens[i]])
                rows.append(_cond(tuple(out + paths[-1])))
            path, tok = accept_sampling(np.array(rows), tokens, shape, rng)
            out += [tokens[i] for i in path] + [tok]
        key = tuple(out[:3])
        counts[key] = counts.get(key, 0) + 1
    chi2 = 0.0
    for a in range(5):
        for b in range(5):
            for c in range(5):
                expected = n_samples * _cond(())[a] * _cond((a,))[b] * _cond((a, b))[c]
                chi2 += (counts.get((a, b, c), 0) - expected) ** 2 / expected
    df = 124
    z = 3.72  # one-sided 0.9999 quantile: a correct rule fails with probability 1e-4 (fixed seed)
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3  # Wilson-Hilferty
    assert chi2 < critical


def test_sampling_accepts_certain_tokens_and_rejects_impossible_ones():
    rng = np.random.default_rng(0)
    probs = np.array([[0, 1, 0, 0], [0, 0, 1, 0], [0.5, 0.5, 0, 0]], dtype=float)
    for _ in range(20):
        path, tok = accept_sampling(probs, [1, 2], [-1, 0], rng)
        assert path == [0, 1]
        assert tok in (0, 1)
    probs = np.array([[0, 0, 0, 1], [0.25] * 4, [0.25] * 4], dtype=float)
    for _ in range(20):
        path, tok = accept_sampling(probs, [1, 2], [-1, -1], rng)
        assert path == []
        assert tok == 3


# --- prompt prefixes ------------------------------------------------------------


def test_prefill_from_a_saved_prefix_is_exact(model_tok, prompts, reference, eos):
    """A prompt started from another prompt's saved KV decodes as from a fresh prefill."""
    v = Verifier(model_tok[0])
    assert v.saved_prefix() is None  # nothing prefilled yet
    shared = prompts[0][:-3]  # a prompt that shares all but the last tokens of prompts[0]
    v.prefill([*shared, 11, 12, 13])
    saved = v.saved_prefix()
    assert saved is not None
    assert saved.tokens == (*shared, 11, 12)  # all but the pending last token
    assert saved.nbytes > 0
    assert saved.common_prefix(prompts[0]) == len(shared)
    v.prefill(prompts[0], prefix=saved, logits=False)
    assert v.reused_tokens == len(shared)
    assert v.cache_len == len(prompts[0]) - 1
    out: list[int] = []
    while len(out) < MAX_NEW and not (out and out[-1] in eos):
        out += v.step(None)
    assert out[: len(reference[0])] == reference[0]


def test_prefill_of_a_prompt_held_whole_runs_no_forward_pass(model_tok, prompts, reference, eos):
    v = Verifier(model_tok[0])
    v.prefill(prompts[1])
    saved = v.saved_prefix()
    passes = v.forward_passes
    v.prefill(prompts[1], prefix=saved, logits=False)
    assert v.forward_passes == passes  # the prefix held everything but the pending token
    assert v.reused_tokens == len(prompts[1]) - 1
    res_tokens: list[int] = []
    while len(res_tokens) < len(reference[1]):
        res_tokens += v.step(None)
    assert res_tokens[: len(reference[1])] == reference[1]
    # with logits wanted the last token is computed, and a foreign prefix reuses nothing
    assert v.prefill(prompts[1], prefix=saved).shape == (v.vocab_size,)
    v.prefill(prompts[2], prefix=saved)
    assert v.reused_tokens == saved.common_prefix(prompts[2]) < len(prompts[2]) - 1
