"""`agentspec.engine.optimize_for_cpu`: oneDNN-packed linear layers and grouped
attention, checked against the stock model on the real default model.

The module loads its own copy of the model (the shared `model_tok` fixture may
already be packed by an engine).  Timing is not tested here:
``benchmarks/bench_verify.py`` prints the stock and optimized step costs side
by side.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from prereq import missing, require_module

PROMPTS = [
    "Write a SQL query that counts the singers older than 30.",
    'Give me a JSON object with the keys "name" and "age" for Ann, who is 30.',
]


@pytest.fixture(scope="module")
def stock_and_packed(load_model_copy: Callable[[], tuple[Any, Any]]) -> tuple[Any, Any, Any, Any]:
    """``(stock model, packed model, tokenizer, CpuKernels)``: two loads of the default model."""
    torch = require_module("torch")
    from agentspec.engine import optimize_for_cpu

    stock, tok = load_model_copy()
    packed, _ = load_model_copy()
    if not torch.backends.mkldnn.is_available():
        missing("this torch build has no oneDNN (mkldnn)")
    return stock, packed, tok, optimize_for_cpu(packed)


def _ids(tok: Any, text: str) -> list[int]:
    enc = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(enc["input_ids"])


def test_every_linear_layer_is_packed_and_attention_stays_grouped(stock_and_packed):
    import torch

    stock, packed, _, kernels = stock_and_packed
    linears = sum(type(m) is torch.nn.Linear for m in stock.modules())
    assert kernels.linears == linears > 0
    assert kernels.packed_linears == linears, kernels.reason
    assert kernels.attention == "agentspec_sdpa"
    assert kernels.reason == ""
    assert not any(type(m) is torch.nn.Linear for m in packed.modules())
    assert packed.config._attn_implementation == "agentspec_sdpa"
    assert stock.config._attn_implementation == "sdpa"
    # a plain call, outside inference mode (the packed weights are ordinary tensors)
    ids = torch.tensor([[1, 2, 3, 4]])
    want, got = stock(ids).logits.detach(), packed(ids).logits.detach()
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())


def test_a_second_call_changes_nothing_and_reports_the_packed_layers(stock_and_packed):
    from agentspec.engine import optimize_for_cpu

    _, packed, _, kernels = stock_and_packed
    again = optimize_for_cpu(packed)
    assert again == kernels


def test_logits_match_the_stock_model_for_prefill_chains_and_trees(stock_and_packed):
    from agentspec.engine import DraftTree, Verifier

    stock, packed, tok, _ = stock_and_packed
    ids = _ids(tok, PROMPTS[0])
    drafts = [
        None,
        DraftTree((330, 1148), (-1, 0)),
        DraftTree((330, 1148, 2000, 17, 42), (-1, 0, 1, -1, 3)),  # two branches
    ]
    got: list[Any] = []
    for model in (stock, packed):
        v = Verifier(model)
        rows = [v.prefill(ids)]
        for tree in drafts:
            rows.append(v.forward_tree(tree if tree is not None else DraftTree((), ())))
            v.discard(tree if tree is not None else DraftTree((), ()))
        got.append(rows)
    for a, b in zip(*got, strict=True):
        assert a.shape == b.shape
        scale = float(a.abs().max())
        assert float((a - b).abs().max()) <= 1e-4 * scale
        assert a.argmax(dim=-1).tolist() == b.argmax(dim=-1).tolist()


def test_greedy_outputs_equal_the_stock_model_and_speculation_changes_nothing(stock_and_packed):
    from agentspec.engine import Verifier, generate_greedy

    stock, packed, tok, _ = stock_and_packed
    eos = [tok.eos_token_id]
    for text in PROMPTS:
        ids = _ids(tok, text)
        plain = generate_greedy(Verifier(stock), ids, 40, eos).tokens
        fast = generate_greedy(Verifier(packed), ids, 40, eos).tokens
        assert fast == plain
        # the packed model's own output as a draft, wrong from its 5th token on
        draft = [*fast[:4], (fast[4] + 1) % 1000, *fast[5:]]

        def drafter(tokens: list[int], _draft: list[int] = draft, _n: int = len(ids)) -> list[int]:
            done = len(tokens) - _n  # the verifier's tokens: the prompt, then the output
            return _draft[done : done + 6]

        res = generate_greedy(Verifier(packed), ids, 40, eos, drafter=drafter)
        assert res.tokens == fast
        assert res.forward_passes < len(fast)


def test_grouped_attention_equals_repeated_keys(stock_and_packed):
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from agentspec.engine._cpu_kernels import gqa_sdpa_attention

    attn = stock_and_packed[0].model.layers[0].self_attn
    groups = attn.num_key_value_groups
    assert groups > 1
    gen = torch.Generator().manual_seed(1)
    heads, dim, past = attn.config.num_key_value_heads, attn.head_dim, 40
    for q in (1, 3, 6):
        query = torch.randn((1, heads * groups, q, dim), generator=gen)
        key = torch.randn((1, heads, past + q, dim), generator=gen)
        value = torch.randn((1, heads, past + q, dim), generator=gen)
        mask = torch.zeros((1, 1, q, past + q))
        mask[..., past:] = torch.triu(torch.full((q, q), torch.finfo(torch.float32).min), 1)
        want, _ = sdpa_attention_forward(attn, query, key, value, mask, scaling=dim**-0.5)
        got, _ = gqa_sdpa_attention()(attn, query, key, value, mask, scaling=dim**-0.5)
        assert got.shape == want.shape
        assert torch.allclose(got, want, atol=1e-6, rtol=0)
        # no mask: transformers' own path, unchanged
        want, _ = sdpa_attention_forward(attn, query, key, value, None, scaling=dim**-0.5)
        got, _ = gqa_sdpa_attention()(attn, query, key, value, None, scaling=dim**-0.5)
        assert torch.equal(got, want)


def test_a_layer_whose_trial_product_disagrees_is_kept():
    torch = require_module("torch")
    from agentspec.engine._cpu_kernels import _replace_linears, pack_linear

    if not torch.backends.mkldnn.is_available():
        missing("this torch build has no oneDNN (mkldnn)")
    good = torch.nn.Linear(64, 32)
    bad = torch.nn.Linear(64, 32)
    with torch.no_grad():
        bad.weight[3, 5] = float("nan")  # the trial's output is not finite
    assert pack_linear(bad) is None
    wide = torch.nn.Linear(64, 32).double()  # not float32: left alone
    model = torch.nn.Sequential(good, torch.nn.ReLU(), torch.nn.Sequential(bad, wide))
    found, packed = _replace_linears(model)
    assert (found, packed) == (2, 1)
    assert type(model[0]) is not torch.nn.Linear
    assert model[2][0] is bad
    assert model[2][1] is wide
    x = torch.randn((2, 64))
    assert torch.allclose(model[0](x), good(x), atol=1e-5)


def test_the_engine_packs_unless_told_not_to(stock_and_packed, load_model_copy):
    import torch

    from agentspec.engine import Engine, EngineOptions

    _, _, tok, kernels = stock_and_packed
    model, _ = load_model_copy()
    engine = Engine(model, tok, EngineOptions(cpu_kernels=False, metrics=False))
    try:
        assert engine.cpu_kernels is None
        assert any(type(m) is torch.nn.Linear for m in model.modules())
    finally:
        engine.close()
    engine = Engine(model, tok, EngineOptions(metrics=False))
    try:
        assert engine.cpu_kernels == kernels
        assert not any(type(m) is torch.nn.Linear for m in model.modules())
    finally:
        engine.close()
