"""Speculative verification on a transformers causal LM with a KV cache (CPU).

State.  The verifier keeps a `transformers.DynamicCache` holding the KV of
every committed token except the last one, the *pending* token (the last
prompt token after `Verifier.prefill`, then each step's bonus token).

Step.  `Verifier.step` runs one forward pass over ``[pending] + draft
nodes``: the pending token sits at position ``L`` (the cache length), draft
node i at ``L + depth(i)``, and a custom 4D additive mask lets every row see
the whole cache, the pending token, and node i's own ancestors and itself
(for a chain this is the ordinary causal mask).  Row 0's logits score the
draft's roots, row ``1 + i``'s the children of node i.  Greedy acceptance
walks from the root, at each step taking the child equal to the argmax; the
argmax after the last accepted node is the bonus token (so every step
yields at least one token, and with no draft it is plain greedy decoding).

KV cache after a step.  The cache must hold the committed prefix, the
pending token and the accepted path, in order.  For a chain (or a tree
whose accepted nodes are its first nodes) the accepted entries are already
in place and the rejected tail is cropped (``DynamicCache.crop(-k)``).
Otherwise the accepted nodes' K/V entries are *re-indexed* into place: for
each layer, the m accepted columns are copied over the slots right after
the pending token, then the tail is cropped.  This is exact (every node's
keys were computed at its true position with exactly its true context)
and costs one gather of m columns per layer, not a second forward pass
over the accepted tokens (the alternative: crop to the prefix and re-run
them, about the cost of another decode step).

Prompt prefixes.  `Verifier.saved_prefix` keeps the KV of the last
sequence's prompt (a view, no copy); `Verifier.prefill` given such a
`SavedPrefix` copies the KV of the longest common prefix into the new cache
and runs only the rest of the prompt.  Every key and value is computed with
its true position and context, so this is exact (as any cached decoding).

The model gets the cache as ``cache=`` (transformers 5.24 renamed the
argument; ``past_key_values=`` is deprecated there and goes in 5.40), so
the ``local`` extra requires transformers 5.24.
"""

from __future__ import annotations

import operator
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from agentspec.engine._draft_tree import DraftLike, DraftTree, as_draft_tree
from agentspec.engine._logits import process_logits
from agentspec.engine._sampling import (
    SamplingParams,
    filtered_probs,
    position_noise,
    race_pick,
    walk_draft,
)
from agentspec.exceptions import InvalidArgumentError, InvalidTokenError

__all__ = ["DraftInput", "SavedPrefix", "Verifier"]

DraftInput = (
    DraftTree | DraftLike | tuple[Sequence[int], Sequence[int] | None] | Sequence[int] | None
)
"""What `Verifier.step` accepts as a draft (see `as_draft_tree`)."""


@dataclass(frozen=True)
class SavedPrefix:
    """The KV cache of some prompt tokens, to start a later prompt that shares them.

    Attributes:
        tokens: the token ids whose keys and values are held, in order.
        layers: per layer, ``(keys, values)`` tensors of ``len(tokens)`` positions.
        nbytes: bytes of memory the tensors keep alive.
    """

    tokens: tuple[int, ...]
    layers: tuple[tuple[Any, Any], ...]
    nbytes: int

    def common_prefix(self, ids: Sequence[int]) -> int:
        """How many leading tokens of ``ids`` this prefix holds."""
        n = min(len(ids), len(self.tokens))
        i = 0
        tokens = self.tokens
        while i < n and tokens[i] == ids[i]:
            i += 1
        return i


def _import_torch() -> Any:
    """The torch module, or an error naming the extra to install."""
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            'the embedded engine needs torch: pip install "agentspec[local]"'
        ) from exc
    return torch


class Verifier:
    """Verify drafts against a causal LM, one forward pass per step.

    Args:
        model: a transformers causal LM (``AutoModelForCausalLM``) whose
            cache is a `DynamicCache` of plain (non-sliding) layers.
        device: where input tensors go (the model must already be there).

    Not thread-safe: one verifier serves one sequence at a time.
    """

    def __init__(self, model: Any, *, device: str = "cpu") -> None:
        """Wrap ``model`` (put into eval mode); call `prefill` before `step`."""
        self._torch = _import_torch()
        from transformers import DynamicCache

        self._cache_cls = DynamicCache
        self.model = model.eval()
        self.device = self._torch.device(device)
        config = model.config
        self.vocab_size: int = int(config.vocab_size)
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None)
        self._dtype = next(model.parameters()).dtype
        self._cache: Any = None
        self._tokens: list[int] = []  # committed tokens; the last one is pending
        self._prompt_len = 0  # the first tokens of _tokens are the prompt
        self.forward_passes = 0
        #: Prompt tokens the last `prefill` took from its ``prefix`` instead of computing.
        self.reused_tokens = 0

    # --- state -----------------------------------------------------------------

    @property
    def tokens(self) -> list[int]:
        """The committed context: prompt plus every emitted token (a copy)."""
        return list(self._tokens)

    @property
    def output(self) -> list[int]:
        """The tokens emitted since `prefill` (a copy)."""
        return self._tokens[self._prompt_len :]

    @property
    def cache_len(self) -> int:
        """Tokens whose KV is in the cache (all committed tokens but the pending one)."""
        return 0 if self._cache is None else int(self._cache.get_seq_length())

    def room(self) -> int | None:
        """How many draft nodes deep the next step may go (None: no position limit)."""
        if self.max_positions is None:
            return None
        return self.max_positions - len(self._tokens)

    # --- forward passes --------------------------------------------------------

    def _check_tokens(self, ids: Sequence[int], name: str) -> list[int]:
        """``ids`` as a list of ints in ``[0, vocab_size)``."""
        if isinstance(ids, (str, bytes)):
            raise TypeError(f"{name} must be a sequence of ints")
        try:
            out = [operator.index(t) for t in ids]
        except TypeError:
            raise TypeError(f"{name} must be a sequence of ints") from None
        for i, t in enumerate(out):
            if not 0 <= t < self.vocab_size:
                raise InvalidTokenError(f"{name} token {t} outside [0, {self.vocab_size})", i)
        return out

    def prefill(
        self, prompt_ids: Sequence[int], *, prefix: SavedPrefix | None = None, logits: bool = True
    ) -> Any:
        """Start a sequence: run the prompt and return the last position's logits.

        The returned logits (a float32 tensor of shape ``(vocab,)``) score the
        first generated token.  The prompt's last token stays pending: the
        first `step` recomputes it together with the first draft.

        With ``prefix`` (a `saved_prefix` of an earlier prompt), the keys and
        values of the tokens the prompt shares with it are copied instead of
        computed (`reused_tokens` says how many).  With ``logits=False``
        nothing is returned and a prompt the prefix holds whole (but its last
        token) needs no forward pass at all.

        Raises:
            InvalidArgumentError: empty prompt or longer than the model's context.
            TypeError, InvalidTokenError: bad token ids.
        """
        ids = self._check_tokens(prompt_ids, "prompt")
        if not ids:
            raise InvalidArgumentError("the prompt must not be empty")
        if self.max_positions is not None and len(ids) > self.max_positions:
            raise InvalidArgumentError(
                "prompt longer than the model's context", f"{len(ids)} > {self.max_positions}"
            )
        torch = self._torch
        cache = self._cache_cls(config=self.model.config)
        # the last prompt token is always computed or left pending, never reused
        reused = 0 if prefix is None else prefix.common_prefix(ids[:-1])
        out = None
        with torch.inference_mode():
            for i, (keys, values) in enumerate(prefix.layers if prefix and reused else ()):
                cache.update(keys[:, :, :reused], values[:, :, :reused], i)
            if logits or reused < len(ids) - 1:
                out = self.model(
                    input_ids=torch.tensor([ids[reused:]], device=self.device),
                    cache=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                self.forward_passes += 1
                cache.crop(-1)  # the last prompt token stays pending
        self._cache = cache
        self._tokens = ids
        self._prompt_len = len(ids)
        self.reused_tokens = reused
        return None if out is None or not logits else out.logits[0, -1].float()

    def saved_prefix(self) -> SavedPrefix | None:
        """The KV of the current prompt but its last token, for a later `prefill`
        (views of the cache, no copy; None before a prefill or for a one-token prompt).

        Steps never write into the prompt's positions, so the views stay valid
        while the sequence goes on and after the next `prefill` replaces it.
        """
        n = self._prompt_len - 1
        if self._cache is None or n < 1:
            return None
        layers: list[tuple[Any, Any]] = []
        storages: dict[int, int] = {}
        for layer in self._cache.layers:
            keys, values = layer.keys[:, :, :n], layer.values[:, :, :n]
            layers.append((keys, values))
            for t in (keys, values):
                store = t.untyped_storage()
                storages[store.data_ptr()] = store.nbytes()
        return SavedPrefix(tuple(self._tokens[:n]), tuple(layers), sum(storages.values()))

    def _mask(self, tree: DraftTree, base: int) -> Any:
        """The ``(1, 1, 1 + n, base + 1 + n)`` additive mask for a step."""
        torch = self._torch
        n = len(tree)
        allowed = np.ones((1 + n, base + 1 + n), dtype=bool)
        allowed[0, base + 1 :] = False
        if n:
            allowed[1:, base + 1 :] = tree.ancestors()
        mask = torch.zeros((1 + n, base + 1 + n), dtype=self._dtype)
        mask.masked_fill_(torch.from_numpy(~allowed), torch.finfo(self._dtype).min)
        return mask.to(self.device)[None, None]

    def forward_tree(self, tree: DraftTree) -> Any:
        """One forward pass over ``[pending] + tree``; returns the ``(1 + n, vocab)`` logits.

        The cache afterwards holds every row's KV; `commit` puts it back in
        order.  Exposed for benchmarks and for callers that accept by
        themselves.
        """
        if self._cache is None:
            raise InvalidArgumentError("call prefill() before step()")
        room = self.room()
        if room is not None and tree.depths and max(tree.depths) > room:
            raise InvalidArgumentError(
                "draft deeper than the model's remaining context", f"room for {room} tokens"
            )
        torch = self._torch
        base = self.cache_len
        ids = [self._tokens[-1], *tree.tokens]
        pos = [base, *(base + d for d in tree.depths)]
        with torch.inference_mode():
            out = self.model(
                input_ids=torch.tensor([ids], device=self.device),
                position_ids=torch.tensor([pos], device=self.device),
                attention_mask=self._mask(tree, base),
                cache=self._cache,
                use_cache=True,
            )
        self.forward_passes += 1
        return out.logits[0].float()

    def discard(self, tree: DraftTree) -> None:
        """Undo `forward_tree` on ``tree``: drop its rows from the cache, commit nothing."""
        self._cache.crop(-(1 + len(tree)))

    def commit(self, tree: DraftTree, path: Sequence[int], token: int) -> list[int]:
        """Keep the accepted ``path`` (node indices, root first) and make ``token`` pending.

        Must follow `forward_tree` on the same ``tree``.  Returns the emitted
        tokens: the path's tokens then ``token``.
        """
        n, m = len(tree), len(path)
        base = self.cache_len - 1 - n  # cache length before the forward pass
        if list(path) != list(range(m)):
            src = self._torch.tensor([base + 1 + i for i in path], device=self.device)
            dst = slice(base + 1, base + 1 + m)
            with self._torch.inference_mode():
                for layer in self._cache.layers:
                    layer.keys[:, :, dst] = layer.keys[:, :, src]
                    layer.values[:, :, dst] = layer.values[:, :, src]
        if n > m:
            self._cache.crop(m - n)
        emitted = [tree.tokens[i] for i in path]
        emitted.append(int(token))
        self._tokens.extend(emitted)
        return emitted

    # --- steps -----------------------------------------------------------------

    def step(
        self,
        draft: DraftInput = None,
        *,
        sampling: SamplingParams | None = None,
        rng: np.random.Generator | None = None,
        seed: int | None = None,
        choice: int = 0,
    ) -> list[int]:
        """Verify one draft; return the emitted tokens (accepted ones, then the bonus token).

        Every position is decided as plain decoding decides it: its logits
        are processed with the context it has (prompt, output so far, and
        the draft tokens accepted before it: `process_logits`), then the
        argmax (greedy) or the token the position's exponential race picks
        (`race_pick`, `walk_draft`).  A draft child is accepted when it
        carries that token.  So the emitted tokens equal those of decoding
        without a draft with the same noise.

        Args:
            draft: token ids + parents (`agentspec.Draft`, a ``(token_ids,
                parents)`` pair with parents None for a chain, a plain list
                for a chain, or None for no draft).
            sampling: None for plain greedy acceptance; otherwise these
                parameters (greedy below `SAMPLING_EPS`), lossless with
                respect to sampling from the target with them.
            rng: draws the noise of each position when ``seed`` is None
                (then it depends on the steps taken).
            seed: the noise of output position k (counted from the
                prefill) is ``position_noise(seed, choice, k, vocab)``.
                Default (neither): a random seed for this step.
            choice: the choice index keyed into the noise.

        Raises:
            InvalidArgumentError: no prefill yet, a malformed draft, or a draft
                deeper than the model's remaining context.
            TypeError, InvalidTokenError: bad draft tokens.
        """
        tree = as_draft_tree(draft, self.vocab_size)
        logits = self.forward_tree(tree)
        if sampling is None or (sampling.greedy and not sampling.modifies_logits):
            best = logits.argmax(dim=-1).tolist()
            path, token = walk_draft(tree.tokens, tree.parents, lambda row, _d, _a: best[row])
            return self.commit(tree, path, token)
        rows = logits.numpy()
        prompt = self._tokens[: self._prompt_len]
        output = self.output
        params = sampling

        def processed(row: int, accepted: list[int]) -> np.ndarray:
            return process_logits(rows[row : row + 1], params, prompt, output, [accepted])

        if params.greedy:
            path, token = walk_draft(
                tree.tokens,
                tree.parents,
                lambda row, _d, acc: int(processed(row, acc)[0].argmax()),
            )
            return self.commit(tree, path, token)
        noise = self._noise(len(output), rng, seed, choice)

        def sample(row: int, depth: int, accepted: list[int]) -> int:
            return race_pick(filtered_probs(processed(row, accepted), params)[0], noise(depth))

        path, token = walk_draft(tree.tokens, tree.parents, sample)
        return self.commit(tree, path, token)

    def _noise(
        self, position: int, rng: np.random.Generator | None, seed: int | None, choice: int
    ) -> Callable[[int], np.ndarray]:
        """``depth -> exponentials`` of the output position ``position + depth``."""
        vocab = self.vocab_size
        if seed is None and rng is not None:
            gen = rng
            return lambda _depth: gen.standard_exponential(vocab)
        key = secrets.randbits(63) if seed is None else seed
        return lambda depth: position_noise(key, choice, position + depth, vocab)
