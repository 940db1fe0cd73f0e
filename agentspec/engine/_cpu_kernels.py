"""Faster CPU kernels for the embedded engine's model: a step that verifies a
draft should cost about what a plain decode step costs.

Why.  On a CPU a decode step of a small model streams every weight from memory
once; verifying ``n`` draft tokens in the same pass should cost little more.
With stock PyTorch it did not (SmolLM2-135M, 2 cores, 800 tokens of
context): a plain step took 65 ms and a step verifying 1 to 4 draft tokens
95 to 140 ms, so a rejected draft cost half a step or more.  Two causes,
both measured with the PyTorch profiler:

* ``nn.Linear`` (MKL ``sgemm``) costs about one matrix-vector product per row
  for 2 or 3 rows: the 49152 x 576 output layer took 9.7 ms for one row and
  32.6 ms for three.
* transformers' SDPA attention folds a single query's grouped heads into the
  key/value heads, but for several queries copies the whole key/value cache
  once per query group (``repeat_kv``) in every layer.

`optimize_for_cpu` changes both, in place, on a model that runs on the CPU:

* Every ``nn.Linear`` with float32 weights is replaced (`pack_linear`): its
  weight reordered once by oneDNN (``torch.ops.mkldnn._reorder_linear_weight``,
  the prepacked linear PyTorch's own compiler uses when it freezes a model) and
  applied with ``torch.ops.mkldnn._linear_pointwise``.  Its cost is nearly flat
  from 1 to 4 rows and below MKL's for one row (output layer: 3.7 ms for one
  row, 3.9 ms for three).  A layer is packed only when a trial product on
  random input agrees with ``F.linear`` (relative error below 1e-4), so a
  build without oneDNN, or one whose oneDNN misbehaves, keeps its layers.
* Attention goes through `gqa_sdpa_attention`'s function, registered with transformers
  as ``agentspec_sdpa``: ``F.scaled_dot_product_attention`` with
  ``enable_gqa=True`` whenever a mask is given, which attends each key/value
  head for its whole query group without copying the cache, for one query
  row as for many.  Its output equals the ``repeat_kv`` path's exactly.

Both are exact arithmetic on the same inputs, rounded differently: logits
move by about 1e-4, as they do between any two BLAS builds.  What the engine
promises is unchanged: with speculation on and off the same model (packed or
not) produces the same tokens.  The embedded engine applies this by default
(`EngineOptions.cpu_kernels`); ``benchmarks/bench_verify.py --parts cost``
measures the gain (stock, then packed, in one run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ATTENTION_NAME", "CpuKernels", "gqa_sdpa_attention", "optimize_for_cpu", "pack_linear"]

#: The name the GQA-aware attention is registered under with transformers.
ATTENTION_NAME = "agentspec_sdpa"

#: Rows the packed weights are laid out for: a verification step's pending
#: token plus a few draft tokens.
_PACK_ROWS = 4

#: Largest relative error a packed layer may show on its trial product.
_TRIAL_TOLERANCE = 1e-4


@dataclass(frozen=True)
class CpuKernels:
    """What `optimize_for_cpu` changed.

    Attributes:
        packed_linears: ``nn.Linear`` layers now applied by oneDNN.
        linears: float32 ``nn.Linear`` layers found.
        attention: the attention implementation in use afterwards.
        reason: why something was left as it was ("" when nothing was).
    """

    packed_linears: int
    linears: int
    attention: str
    reason: str = ""


def _torch() -> Any:
    import torch

    return torch


def _make_packed_linear_class() -> Any:
    torch = _torch()

    class _PackedLinear(torch.nn.Module):  # type: ignore[misc,name-defined]
        """An ``nn.Linear`` whose weight oneDNN reordered once; same inputs, same outputs."""

        def __init__(self, packed: Any, bias: Any, in_features: int, out_features: int) -> None:
            super().__init__()
            self.in_features = in_features
            self.out_features = out_features
            self.register_buffer("packed_weight", packed, persistent=False)
            self.register_buffer("bias", bias, persistent=False)

        def forward(self, x: Any) -> Any:
            return torch.ops.mkldnn._linear_pointwise(
                x, self.packed_weight, self.bias, "none", [], ""
            )

        def extra_repr(self) -> str:
            return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN"

    return _PackedLinear


_PACKED_CLASS: Any = None


def pack_linear(linear: Any) -> Any:
    """A packed copy of ``linear`` (float32 ``nn.Linear`` on the CPU), or None when
    oneDNN is unavailable or its trial product disagrees with ``F.linear``."""
    global _PACKED_CLASS
    torch = _torch()
    if _PACKED_CLASS is None:
        _PACKED_CLASS = _make_packed_linear_class()
    weight = linear.weight.detach()
    bias = None if linear.bias is None else linear.bias.detach()
    try:
        with torch.no_grad():  # not inference mode: the packed weight outlives it
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_ROWS)
        with torch.inference_mode():
            gen = torch.Generator().manual_seed(0)
            # shaped as the model calls it: (batch, rows, features)
            x = torch.randn((1, 3, weight.shape[1]), generator=gen, dtype=weight.dtype)
            want = torch.nn.functional.linear(x, weight, bias)
            got = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    except (RuntimeError, AttributeError, NotImplementedError, TypeError):
        return None
    if got.shape != want.shape:
        return None
    scale = float(want.abs().max()) or 1.0
    if not float((got - want).abs().max()) <= _TRIAL_TOLERANCE * scale:
        return None
    return _PACKED_CLASS(packed, bias, int(weight.shape[1]), int(weight.shape[0]))


_GQA_ATTENTION: Any = None


def gqa_sdpa_attention() -> Any:
    """The attention function registered as `ATTENTION_NAME` (transformers' attention
    interface), built once: SDPA with grouped key/value heads left grouped
    (``enable_gqa``) when a mask is given; transformers' own SDPA otherwise (no
    mask, a position bias, soft-capping).  Its imports are resolved here, not on
    each of its calls (one per layer per step)."""
    global _GQA_ATTENTION
    if _GQA_ATTENTION is not None:
        return _GQA_ATTENTION
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    sdpa = _torch().nn.functional.scaled_dot_product_attention

    def attention(
        module: Any,
        query: Any,
        key: Any,
        value: Any,
        attention_mask: Any,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        **kwargs: Any,
    ) -> tuple[Any, None]:
        if (
            attention_mask is None
            or getattr(module, "num_key_value_groups", 1) <= 1
            or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None
            or kwargs.get("output_attentions", False)
        ):
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
            )
        out = sdpa(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=dropout,
            scale=scaling,
            enable_gqa=True,
        )
        return out.transpose(1, 2).contiguous(), None

    _GQA_ATTENTION = attention
    return attention


def _register_attention() -> bool:
    """Register `gqa_sdpa_attention`'s function (and SDPA's mask) under `ATTENTION_NAME`."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return False
    AttentionInterface.register(ATTENTION_NAME, gqa_sdpa_attention())
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    return True


def _replace_linears(model: Any) -> tuple[int, int]:
    torch = _torch()
    found = packed = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _PACKED_CLASS is not None and isinstance(child, _PACKED_CLASS):
                found += 1  # packed by an earlier call
                packed += 1
                continue
            if type(child) is not torch.nn.Linear or child.weight.dtype != torch.float32:
                continue
            if child.weight.device.type != "cpu":
                continue
            found += 1
            new = pack_linear(child)
            if new is not None:
                setattr(parent, name, new)
                packed += 1
    return found, packed


def optimize_for_cpu(model: Any) -> CpuKernels:
    """Pack ``model``'s float32 linear layers for oneDNN and switch its attention to
    `gqa_sdpa_attention`, in place (see the module docstring).

    A model on another device, or one transformers cannot switch, is left as it
    was for that part; the returned `CpuKernels` says what changed.
    """
    reasons: list[str] = []
    torch = _torch()
    first = next(model.parameters(), None)
    if first is not None and first.device.type != "cpu":
        attention = str(getattr(model.config, "_attn_implementation", "") or "")
        return CpuKernels(0, 0, attention, "not on the CPU")
    if not torch.backends.mkldnn.is_available():
        found, packed = 0, 0
        reasons.append("oneDNN is not available in this torch build")
    else:
        found, packed = _replace_linears(model)
        if packed < found:
            reasons.append(f"{found - packed} linear layers failed oneDNN's trial product")
    attention = str(getattr(model.config, "_attn_implementation", "") or "")
    if attention == "sdpa" and _register_attention():
        try:
            model.set_attn_implementation(ATTENTION_NAME)
            attention = ATTENTION_NAME
        except (ValueError, AttributeError, KeyError) as exc:
            reasons.append(f"attention left as {attention}: {exc}")
    elif attention != ATTENTION_NAME:
        reasons.append(f"attention left as {attention or 'unknown'}")
    return CpuKernels(packed, found, attention, "; ".join(reasons))
