"""Per-position logits processing: the part of sampling that depends on the context.

`process_logits` applies, to each row of logits, what vLLM's sampler applies
before temperature, in its order:

1. ``allowed_token_ids``: every other token's logit becomes -inf;
2. ``logit_bias``: added to the listed tokens' logits;
3. ``repetition_penalty`` r: for every token in the prompt or the output so
   far, a positive logit is divided by r, any other multiplied by r;
4. ``frequency_penalty`` f: minus f times the token's count in the output;
5. ``presence_penalty`` q: minus q for every token that is in the output.

Row i has its own output: the output so far plus ``accepted[i]``, the draft
tokens before that row's position.  A verification step scores position
``len(output) + j`` with the ``j`` draft tokens accepted before it, exactly
the context non-speculative decoding has there, so penalties never make
speculative and plain decoding disagree.  `target_distribution` then turns
a processed row into probabilities (`filtered_probs`).

The processing is vectorised over rows; only the columns of tokens that
occur in the prompt, the output or a row's accepted tokens are touched.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from agentspec.engine._sampling import SamplingParams, filtered_probs

__all__ = ["process_logits", "target_distribution"]


def process_logits(
    logits: np.ndarray,
    params: SamplingParams,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    accepted: Sequence[Sequence[int]] | None = None,
) -> np.ndarray:
    """``(R, V)`` logits with allowed_token_ids, logit_bias and the penalties applied.

    Args:
        logits: ``(R, V)`` (or ``(V,)``, one row) raw model logits.
        params: the sampling parameters.
        prompt: the prompt's tokens (count for the repetition penalty only).
        output: the output tokens before row 0's position.
        accepted: per row, the tokens between ``output`` and that row's
            position (None: none for every row).

    Returns a new float64 array of the input's shape; the input is unchanged.
    Token ids outside ``[0, V)`` in the bias or the allowed list are ignored.
    """
    x = np.array(logits, dtype=np.float64)  # a copy
    one_row = x.ndim == 1
    if one_row:
        x = x[None]
    rows, vocab = x.shape
    if params.allowed_token_ids is not None:
        allowed = np.asarray([t for t in params.allowed_token_ids if t < vocab], dtype=np.int64)
        masked = np.full_like(x, -np.inf)
        masked[:, allowed] = x[:, allowed]
        x = masked
    if params.logit_bias:
        ids = np.asarray([t for t, _ in params.logit_bias], dtype=np.int64)
        bias = np.asarray([b for _, b in params.logit_bias], dtype=np.float64)
        ok = ids < vocab
        added = np.zeros(vocab)
        np.add.at(added, ids[ok], bias[ok])
        x += added
    if params.penalized:
        _penalize(x, params, prompt, output, accepted or [()] * rows)
    return x[0] if one_row else x


def _penalize(
    x: np.ndarray,
    params: SamplingParams,
    prompt: Sequence[int],
    output: Sequence[int],
    accepted: Sequence[Sequence[int]],
) -> None:
    """Apply the three penalties to ``x`` (rows, vocab) in place."""
    rows = x.shape[0]
    if len(accepted) != rows:
        raise ValueError(f"accepted has {len(accepted)} rows, logits {rows}")
    p_ids = np.asarray(prompt, dtype=np.int64)
    o_ids = np.asarray(output, dtype=np.int64)
    a_ids = np.asarray([t for acc in accepted for t in acc], dtype=np.int64)
    a_rows = np.repeat(np.arange(rows), [len(acc) for acc in accepted])
    cols = np.unique(np.concatenate([p_ids, o_ids, a_ids]))
    if cols.size == 0:
        return
    counts = np.zeros((rows, cols.size))  # output occurrences per row, per column
    counts += np.bincount(np.searchsorted(cols, o_ids), minlength=cols.size)[None]
    np.add.at(counts, (a_rows, np.searchsorted(cols, a_ids)), 1.0)
    in_output = counts > 0
    sub = x[:, cols]
    if params.repetition_penalty != 1:
        in_prompt = np.zeros(cols.size, dtype=bool)
        in_prompt[np.searchsorted(cols, p_ids)] = True
        seen = in_output | in_prompt[None]
        r = params.repetition_penalty
        sub = np.where(seen, np.where(sub > 0, sub / r, sub * r), sub)
    if params.frequency_penalty != 0:
        sub = sub - params.frequency_penalty * counts
    if params.presence_penalty != 0:
        sub = sub - params.presence_penalty * in_output
    x[:, cols] = sub


def target_distribution(
    logits: np.ndarray,
    params: SamplingParams,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    accepted: Sequence[Sequence[int]] | None = None,
) -> np.ndarray:
    """The distribution each row samples from: `process_logits`, then `filtered_probs`."""
    return filtered_probs(process_logits(logits, params, prompt, output, accepted), params)
