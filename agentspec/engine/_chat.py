"""Text around the engine's tokens: chat prompts, incremental detokenisation, stop strings.

`render_chat` turns OpenAI chat messages into prompt token ids with the
tokenizer's own chat template (``apply_chat_template``).  `TextDecoder`
turns generated token ids into text one token at a time, the way streaming
servers do (a short window of earlier tokens is decoded with each new one,
so multi-token characters and leading-space rules come out right), and cuts
the text at the first stop string: the stop text is never emitted, and text
that might still grow into a stop string is held back until it cannot.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from agentspec.exceptions import InvalidArgumentError

__all__ = [
    "TextDecoder",
    "chat_messages",
    "max_token_bytes",
    "prompt_bytes",
    "render_chat",
    "short_repr",
    "text_bytes",
    "tokenize_prompt",
]

#: Roles a chat message may have.
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
#: Tokens of context decoded together with each new token.
_WINDOW = 6
#: `max_token_bytes` of a tokenizer whose vocabulary cannot be decoded.
_FALLBACK_TOKEN_BYTES = 256


def short_repr(value: Any) -> str:
    """A short, safe description of a request value for an error message."""
    if isinstance(value, str):
        return repr(value[:40])
    if value is None or isinstance(value, (bool, int, float)):
        text = repr(value)
        return text if len(text) <= 40 else text[:37] + "..."
    return f"a JSON {'array' if isinstance(value, list) else 'object'}"


def _check_utf8(text: str, where: str) -> str:
    """``text`` if it encodes as UTF-8 (JSON may carry lone surrogates, ``"\\ud800"``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(
            f"{where} is not valid Unicode text", f"a lone surrogate at index {exc.start}"
        ) from None
    return text


def max_token_bytes(tokenizer: Any) -> int:
    """The most UTF-8 bytes one token of ``tokenizer`` decodes to (special tokens included).

    A token that is part of a multi-byte character decodes to U+FFFD (3
    bytes), more than it stands for: the result is an upper bound.
    """
    try:
        n = len(tokenizer)
        texts = tokenizer.batch_decode([[i] for i in range(n)], skip_special_tokens=False)
        longest = max(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    except Exception:  # an unusual tokenizer: a generous fixed bound
        return _FALLBACK_TOKEN_BYTES
    return max(1, int(longest))


def _content_text(content: Any, where: str) -> str:
    """A message's content as text: a string or a list of ``{"type": "text"}`` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return _check_utf8(content, f"{where}.content")
    if isinstance(content, list):
        parts: list[str] = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type", "text") != "text":
                raise InvalidArgumentError(
                    f"{where}.content[{j}]: only text parts are supported",
                    "this engine serves a text-only model",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidArgumentError(f"{where}.content[{j}].text must be a string")
            parts.append(text)
        return _check_utf8("".join(parts), f"{where}.content")
    raise InvalidArgumentError(f"{where}.content must be a string or a list of text parts")


def chat_messages(messages: Any) -> list[dict[str, str]]:
    """Validate OpenAI chat ``messages``; return ``[{"role", "content"}]`` with text content.

    Raises:
        InvalidArgumentError: not a non-empty list of messages with a known
            role and text content.
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidArgumentError("'messages' must be a non-empty list of messages")
    out: list[dict[str, str]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise InvalidArgumentError(f"{where} must be an object")
        role = msg.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise InvalidArgumentError(
                f"{where}.role must be one of {', '.join(sorted(_ROLES))}", short_repr(role)
            )
        if msg.get("tool_calls") or msg.get("function_call"):
            raise InvalidArgumentError(
                f"{where}: tool calls in messages are not supported",
                "this engine has no native tool calling; put calls in the content as text",
            )
        out.append({"role": role, "content": _content_text(msg.get("content"), where)})
    return out


def _ids_of(encoded: Any) -> list[int]:
    """Token ids from what ``apply_chat_template`` / ``__call__`` returned."""
    if isinstance(encoded, dict) or hasattr(encoded, "keys"):
        encoded = encoded["input_ids"]
    ids = list(encoded)
    if ids and isinstance(ids[0], list):  # a batch of one
        ids = ids[0]
    return [int(t) for t in ids]


def text_bytes(text: str, where: str = "'prompt'") -> int:
    """UTF-8 size of ``text``.

    Raises:
        InvalidArgumentError: a lone surrogate (JSON may carry ``"\\ud800"``).
    """
    if text.isascii():
        return len(text)
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        _check_utf8(text, where)  # raises the error with its message
        raise


def prompt_bytes(messages: list[dict[str, str]]) -> int:
    """UTF-8 bytes of text in validated chat ``messages`` (the template adds more)."""
    return sum(text_bytes(m["content"]) for m in messages)


def _check_size(size: int, max_bytes: int | None) -> None:
    """Refuse a prompt text of over ``max_bytes`` bytes before tokenizing it."""
    if max_bytes is not None and size > max_bytes:
        raise InvalidArgumentError(
            f"the prompt has {size} bytes of text, more than this model's maximum context "
            f"length can hold (prompts over {max_bytes} bytes are refused without tokenizing)"
        )


def render_chat(
    tokenizer: Any,
    messages: Any,
    max_bytes: int | None = None,
    max_len: int | None = None,
) -> list[int]:
    """Prompt token ids of chat ``messages`` (validated), ending with the generation prompt.

    Messages with more than ``max_bytes`` bytes of text (UTF-8), or more
    than ``max_len`` messages (each takes at least one token), are refused
    before the template and the tokenizer run.

    Raises:
        InvalidArgumentError: bad messages, too long, or the template refused them.
    """
    clean = chat_messages(messages)
    if max_bytes is not None:
        # characters first: cheap, and never more than the bytes
        _check_size(sum(len(m["content"]) for m in clean), max_bytes)
        _check_size(prompt_bytes(clean), max_bytes)
    if max_len is not None and len(clean) > max_len:
        raise InvalidArgumentError(
            f"{len(clean)} messages: more than this model's maximum context length "
            f"of {max_len} tokens can hold"
        )
    try:
        encoded = tokenizer.apply_chat_template(clean, add_generation_prompt=True, tokenize=True)
    except (ValueError, TypeError, KeyError) as exc:  # jinja errors raise from the template
        raise InvalidArgumentError(f"the chat template refused the messages: {exc}") from exc
    except Exception as exc:  # jinja2.TemplateError (raise_exception in templates)
        if type(exc).__module__.startswith("jinja2"):
            raise InvalidArgumentError(f"the chat template refused the messages: {exc}") from exc
        raise
    return _ids_of(encoded)


def tokenize_prompt(
    tokenizer: Any,
    prompt: Any,
    vocab_size: int,
    max_bytes: int | None = None,
    max_len: int | None = None,
) -> list[int]:
    """Token ids of a completions ``prompt``: a string, a list of ids, or a list of one of those.

    A string of more than ``max_bytes`` bytes (UTF-8) is refused before it is
    tokenized, a list of ids of ``max_len`` or more before its ids are checked.

    Raises:
        InvalidArgumentError: another shape, several prompts, too long, or ids
            outside the vocabulary.
    """
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidArgumentError("'prompt' must not be empty")
        if max_bytes is not None:
            _check_size(len(prompt), max_bytes)
        _check_size(text_bytes(prompt), max_bytes)
        return _ids_of(tokenizer(prompt))
    if isinstance(prompt, list) and prompt:
        if max_len is not None and len(prompt) >= max_len:
            raise InvalidArgumentError(
                f"the prompt has {len(prompt)} tokens; this model's maximum context "
                f"length is {max_len} tokens (prompt and output together)"
            )
        if all(type(t) is int for t in prompt):
            bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise InvalidArgumentError(f"prompt token {bad} outside [0, {vocab_size})")
            return list(prompt)
        raise InvalidArgumentError("only one prompt per request is supported (n=1 serving)")
    raise InvalidArgumentError("'prompt' must be a non-empty string or a list of token ids")


class TextDecoder:
    """Incremental detokenisation with stop strings.

    Feed generated tokens one at a time with `push`; each call returns the
    text that became final.  Once a stop string appears, `stopped` is True,
    the returned text ends right before it, and further pushes return "".
    Call `flush` at the end of generation for the text held back.

    Args:
        tokenizer: a Hugging Face tokenizer (``decode``).
        stop: stop strings (empty strings are ignored).
        skip_ids: token ids that never produce text (e.g. the eos token).
    """

    def __init__(
        self, tokenizer: Any, stop: Sequence[str] = (), skip_ids: Collection[int] = ()
    ) -> None:
        """Start with no tokens."""
        self._tok = tokenizer
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._skip = frozenset(skip_ids)
        self._ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # tokens whose text is already in _text
        self._text = ""  # decoded so far (may include a partial stop string)
        self._sent = 0  # characters of _text returned
        self.stopped = False

    @property
    def text(self) -> str:
        """The text returned so far."""
        return self._text[: self._sent]

    def _decode(self, ids: list[int]) -> str:
        out: str = self._tok.decode(ids, skip_special_tokens=True)
        return out

    def push(self, token: int) -> str:
        """Add one token; return the text that is now final (possibly "")."""
        if self.stopped:
            return ""
        if token in self._skip:
            return ""
        self._ids.append(token)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the next token
        new = after[len(before) :]
        self._prefix, self._read = max(self._prefix, self._read - _WINDOW), len(self._ids)
        start = max(0, len(self._text) - self._hold)
        self._text += new
        if self._stop:
            cut = min(
                (i for i in (self._text.find(s, start) for s in self._stop) if i >= 0),
                default=-1,
            )
            if cut >= 0:
                self._text = self._text[:cut]
                self.stopped = True
                return self._take(len(self._text))
            return self._take(len(self._text) - self._partial_stop())
        return self._take(len(self._text))

    def _partial_stop(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._text)), best, -1):
                if self._text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _take(self, upto: int) -> str:
        """Return text up to ``upto`` not returned yet."""
        if upto <= self._sent:
            return ""
        out = self._text[self._sent : upto]
        self._sent = upto
        return out

    def flush(self) -> str:
        """The text held back (a possible stop-string start that never completed)."""
        if self.stopped:
            return ""
        if self._read < len(self._ids):  # trailing incomplete bytes: emit what decodes
            before = self._decode(self._ids[self._prefix : self._read])
            after = self._decode(self._ids[self._prefix :])
            if len(after) > len(before):
                self._text += after[len(before) :]
            self._read = len(self._ids)
        return self._take(len(self._text))
