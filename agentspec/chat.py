"""Prompt token ids as a serving engine computes them: chat template, then tokenizer.

`ChatTokenizer` renders a conversation with the model's Jinja chat template
the way Hugging Face ``transformers``' ``apply_chat_template`` does (sandboxed
environment, ``trim_blocks``/``lstrip_blocks``, the ``raise_exception`` and
``strftime_now`` helpers, the special tokens as template variables,
``add_generation_prompt=True``) and encodes the text with the ``tokenizers``
library (``add_special_tokens=False``: control tokens written by the template
are matched as single ids, nothing is added).

`SessionRenderer` computes the prompts of one conversation's successive
requests without re-tokenizing the shared history.  The rendered text is cut
just before and after every control token; the ``tokenizers`` library splits
its input at exactly those places before normalizing and pre-tokenizing, so
encoding the pieces separately gives the same ids as encoding the whole text.
Pieces equal to the previous prompt's are reused, so each message's rendered
span is tokenized once unless the template renders it differently in a later
prompt (Qwen3, for example, re-renders an assistant message that follows the
last user turn); then only the pieces that changed are encoded again.  A
tokenizer whose added tokens strip whitespace or match whole words only, or
whose pre-tokenizer treats the first piece specially, gets whole-prompt
encoding instead.

`chatml_prompt_ids` is the plain ChatML rendering used by the project's
reference figures (``benchmarks/``, `agentspec.bench`); `chatml_message` and
`CHATML_GENERATION_PROMPT` are its two pieces of text.

Needs the optional dependencies ``jinja2`` (>= 3.1.6) and ``tokenizers``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TypeAlias

from agentspec.exceptions import ChatTemplateError, InvalidArgumentError
from agentspec.traces import Message

try:
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.sandbox
    import jinja2.utils
    from tokenizers import Tokenizer
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"agentspec.chat needs jinja2 and tokenizers ({_exc}); "
        "install them with `pip install 'jinja2>=3.1.6' tokenizers`"
    ) from _exc

__all__ = [
    "CHATML_GENERATION_PROMPT",
    "CHATML_TEMPLATE",
    "ChatTemplateError",
    "ChatTokenizer",
    "SessionRenderer",
    "chatml_message",
    "chatml_prompt_ids",
]

ChatMessage: TypeAlias = "Message | Mapping[str, Any]"

#: A Jinja chat template producing exactly the `chatml_prompt_ids` rendering.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Special-token attributes of tokenizer_config.json passed to the template
# (transformers passes its `special_tokens_map`: the ones that are set).
_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


# --- the Jinja environment ----------------------------------------------------


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body unchanged.

    transformers uses the block to locate assistant tokens; here only the text
    matters, but templates that use it must still compile and render alike.
    """

    tags = {"generation"}  # noqa: RUF012 (the attribute jinja2 reads)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        """Parse the block into a call of `_body` with the body as caller."""
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        node: jinja2.nodes.Node = jinja2.nodes.CallBlock(call, [], [], body)
        return node.set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        """Return the rendered body."""
        return caller()


def _raise_exception(message: str) -> None:
    """Template helper ``raise_exception(msg)``: fail rendering with ``msg``."""
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    """Template helper ``strftime_now(fmt)``: the current local time formatted."""
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Template filter ``tojson``: plain `json.dumps` (no HTML escaping), non-ASCII kept."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _check_attr_name(name: object) -> None:
    """Refuse underscore-prefixed namespace attributes (sandbox hardening)."""
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot set underscore-prefixed attributes ({name!r})"
        )


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace()`` for templates, refusing underscore-prefixed attributes."""

    def __setitem__(self, name: str, value: Any) -> None:
        """Set an attribute after checking its name."""
        _check_attr_name(name)
        super().__setitem__(name, value)


def _namespace(*args: Any, **kwargs: Any) -> _TemplateNamespace:
    """Template global ``namespace(...)``."""
    attrs = dict(*args, **kwargs)
    for name in attrs:
        _check_attr_name(name)
    return _TemplateNamespace(attrs)


class _TemplateDict:
    """Template global ``dict``: only construction and ``dict.fromkeys``."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        """``dict(...)``."""
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict[Any, Any]:
        """``dict.fromkeys(...)``."""
        return dict.fromkeys(*args)


def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandboxed environment transformers uses."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _namespace
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from exc


# --- inputs ---------------------------------------------------------------------


def _plain(value: Any, where: str) -> Any:
    """A copy of ``value`` built from plain JSON types only (what a template may see)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k, where): _plain(v, where) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, where) for v in value]
    raise TypeError(f"{where}: a {type(value).__name__} cannot be passed to a chat template")


def _template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation as the template sees it (transformers' normalisation).

    A `Message` becomes ``{"role", "content"}`` (its stage is trace metadata,
    not prompt text).  A mapping is copied with None values dropped and a
    reasoning field, under any of its names, also given as
    ``reasoning_content`` and ``thinking``.
    """
    given: object = messages
    if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
        raise TypeError(f"messages must be a sequence, got {type(given).__name__}")
    if not messages:
        raise InvalidArgumentError("cannot render an empty conversation")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if isinstance(m, Message):
            out.append({"role": m.role, "content": m.content})
        elif isinstance(m, Mapping):
            msg = {str(k): _plain(v, f"messages[{i}]") for k, v in m.items() if v is not None}
            reasoning = next((msg[k] for k in _REASONING_KEYS if k in msg), None)
            if reasoning is not None:
                msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
            out.append(msg)
        else:
            raise TypeError(f"messages[{i}] is a {type(m).__name__}, not a Message or a mapping")
    return out


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


# --- the tokenizer ------------------------------------------------------------------


class ChatTokenizer:
    """A tokenizer plus its chat template: prompt and response ids for a conversation.

    ``tokenizer`` is a ``tokenizers.Tokenizer``; ``chat_template`` the Jinja
    source; ``special_tokens`` maps names such as ``bos_token`` and
    ``eos_token`` to token strings (template variables; ``eos_token`` also
    gives `eos_token_id`).  Most callers use `from_dir`.  Rendering and
    encoding are thread-safe.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str,
        *,
        special_tokens: Mapping[str, str] | None = None,
    ) -> None:
        """Wrap ``tokenizer`` with ``chat_template``; see the class docstring."""
        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"tokenizer must be a tokenizers.Tokenizer, got {type(tokenizer)}")
        if not isinstance(chat_template, str) or not chat_template:
            raise ChatTemplateError("chat_template must be a non-empty string")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens: dict[str, str] = {
            str(k): v for k, v in (special_tokens or {}).items() if isinstance(v, str)
        }
        self._template = _compile_template(chat_template)
        self._splitter, self._control_ids = _control_token_splitter(tokenizer)

    @classmethod
    def from_dir(cls, path: str | Path) -> ChatTokenizer:
        """Load ``tokenizer.json`` and ``tokenizer_config.json`` from a model directory.

        The chat template is ``chat_template.jinja`` when the directory has one,
        else the config's ``chat_template`` (for a list of named templates, the
        one named ``default``).  Truncation and padding stored in
        ``tokenizer.json`` are turned off: prompts are encoded whole.
        """
        d = Path(path)
        tok_file, cfg_file = d / "tokenizer.json", d / "tokenizer_config.json"
        for f in (tok_file, cfg_file):
            if not f.is_file():
                raise FileNotFoundError(f"{f} not found")
        try:
            config = json.loads(cfg_file.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ChatTemplateError(f"{cfg_file}: not valid JSON ({exc})") from None
        if not isinstance(config, dict):
            raise ChatTemplateError(f"{cfg_file}: expected a JSON object")
        jinja_file = d / "chat_template.jinja"
        template: Any
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        else:
            template = config.get("chat_template")
            if isinstance(template, list):
                named = {
                    t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)
                }
                template = named.get("default")
        if not isinstance(template, str) or not template:
            raise ChatTemplateError(f"{d}: no chat template (chat_template in {cfg_file.name})")
        try:
            tokenizer = Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust side raises a plain Exception
            raise ValueError(f"{tok_file}: cannot load tokenizer ({exc})") from exc
        tokenizer.no_truncation()
        tokenizer.no_padding()
        special = {k: _token_content(config.get(k)) for k in _SPECIAL_TOKEN_KEYS}
        return cls(
            tokenizer,
            template,
            special_tokens={k: v for k, v in special.items() if v is not None},
        )

    @property
    def bos_token(self) -> str | None:
        """The BOS token string (``bos_token`` in the config), or None."""
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        """The EOS token string (``eos_token`` in the config), or None."""
        return self.special_tokens.get("eos_token")

    @property
    def eos_token_id(self) -> int | None:
        """The id of `eos_token`, or None if there is none or it is not in the vocabulary."""
        eos = self.eos_token
        if eos is None:
            return None
        tid = self.tokenizer.token_to_id(eos)
        return None if tid is None else int(tid)

    def render(
        self,
        messages: Sequence[ChatMessage],
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` with the chat template into the prompt text.

        ``enable_thinking`` is passed to the template only when not None (so
        None keeps the template's default); other keyword arguments become
        template variables too, overriding the special tokens like in
        transformers.  Template failures raise `ChatTemplateError`.
        """
        chat = _template_messages(messages)
        context: dict[str, Any] = {"tools": None, "documents": None, **self.special_tokens}
        if enable_thinking is not None:
            context["enable_thinking"] = bool(enable_thinking)
        context.update({k: _plain(v, k) for k, v in template_kwargs.items()})
        context["messages"] = chat
        context["add_generation_prompt"] = bool(add_generation_prompt)
        try:
            return self._template.render(context)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (``add_special_tokens=False``; control tokens match)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def prompt_ids(
        self,
        messages: Sequence[ChatMessage],
        *,
        enable_thinking: bool | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Ids of the prompt for the next assistant message: render, then encode whole."""
        text = self.render(messages, enable_thinking=enable_thinking, **template_kwargs)
        return self.encode(text)

    def response_ids(self, text: str, *, append_eos: bool = False) -> list[int]:
        """Ids of a response's content alone, plus `eos_token_id` if ``append_eos``."""
        ids = self.encode(text)
        if append_eos:
            eos = self.eos_token_id
            if eos is None:
                raise InvalidArgumentError("append_eos=True but the tokenizer has no EOS token")
            ids.append(eos)
        return ids

    def session(
        self, *, enable_thinking: bool | None = None, **template_kwargs: Any
    ) -> SessionRenderer:
        """A `SessionRenderer` for one conversation with these template options."""
        return SessionRenderer(self, enable_thinking=enable_thinking, **template_kwargs)

    def __repr__(self) -> str:
        """``ChatTokenizer(vocab=N, eos='...')``."""
        vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
        return f"ChatTokenizer(vocab={vocab}, eos={self.eos_token!r})"


def _control_token_splitter(tokenizer: Tokenizer) -> tuple[re.Pattern[str] | None, dict[str, int]]:
    """A regex matching the added tokens the tokenizer splits its input at, and their ids.

    Returns ``(None, {})`` when splitting at them would not be exact: an added
    token that strips neighbouring whitespace or matches single words only,
    or a Metaspace pre-tokenizer that only prefixes the first piece.
    """
    added = tokenizer.get_added_tokens_decoder()
    if any(t.lstrip or t.rstrip or t.single_word for t in added.values()):
        return None, {}
    if tokenizer.pre_tokenizer is not None:
        try:
            config = json.loads(tokenizer.pre_tokenizer.__getstate__())
        except Exception:  # unknown serialisation: be conservative
            return None, {}
        if any(
            c.get("type") == "Metaspace" and c.get("prepend_scheme") == "first"
            for c in _walk_json(config)
        ):
            return None, {}
    skip_special = bool(getattr(tokenizer, "encode_special_tokens", False))
    ids = {
        t.content: int(i)
        for i, t in added.items()
        if not t.normalized and t.content and not (skip_special and t.special)
    }
    if not ids:
        return None, {}
    # Longest first: at each position the longest token wins, like the
    # tokenizer's leftmost-longest matching.
    alternatives = sorted(ids, key=lambda s: (-len(s), s))
    return re.compile("(" + "|".join(map(re.escape, alternatives)) + ")"), ids


def _walk_json(value: Any) -> Iterator[dict[str, Any]]:
    """Every JSON object nested in ``value`` (itself included)."""
    if isinstance(value, dict):
        yield value
        for v in value.values():
            yield from _walk_json(v)
    elif isinstance(value, list):
        for v in value:
            yield from _walk_json(v)


class SessionRenderer:
    """Prompt ids for the successive requests of one conversation, tokenized incrementally.

    Call `prompt_ids` with each request's prompt messages in order (each
    prompt normally extends the previous one).  The result always equals
    ``chat.prompt_ids(messages)``; the text pieces shared with the previous
    prompt (split at control tokens, see the module docstring) are not
    encoded again.  Not thread-safe: use one renderer per conversation.
    """

    def __init__(
        self, chat: ChatTokenizer, *, enable_thinking: bool | None = None, **template_kwargs: Any
    ) -> None:
        """A renderer for ``chat`` with fixed template options."""
        if not isinstance(chat, ChatTokenizer):
            raise TypeError(f"chat must be a ChatTokenizer, got {type(chat).__name__}")
        self.chat = chat
        self._enable_thinking = enable_thinking
        self._kwargs = template_kwargs
        self._pieces: list[str] = []
        self._piece_ids: list[list[int]] = []
        #: Characters encoded so far, and characters whose ids were reused.
        self.encoded_chars = 0
        self.reused_chars = 0

    @property
    def incremental(self) -> bool:
        """False when this tokenizer needs whole-prompt encoding (see the module docstring)."""
        return self.chat._splitter is not None

    def reset(self) -> None:
        """Forget the previous prompt (start of a new conversation)."""
        self._pieces = []
        self._piece_ids = []

    def prompt_ids(self, messages: Sequence[ChatMessage]) -> list[int]:
        """Ids of the prompt for the next assistant message after ``messages``."""
        text = self.chat.render(messages, enable_thinking=self._enable_thinking, **self._kwargs)
        splitter = self.chat._splitter
        if splitter is None:
            self.encoded_chars += len(text)
            return self.chat.encode(text)
        pieces = [p for p in splitter.split(text) if p]
        old = self._pieces
        k = 0
        limit = min(len(pieces), len(old))
        while k < limit and pieces[k] == old[k]:
            k += 1
        self.reused_chars += sum(len(p) for p in pieces[:k])
        control = self.chat._control_ids
        new_ids: list[list[int] | None] = [
            [control[p]] if p in control else None for p in pieces[k:]
        ]
        todo = [j for j, ids in enumerate(new_ids) if ids is None]
        if todo:
            texts = [pieces[k + j] for j in todo]
            self.encoded_chars += sum(len(t) for t in texts)
            encodings = self.chat.tokenizer.encode_batch(texts, add_special_tokens=False)
            for j, enc in zip(todo, encodings, strict=True):
                new_ids[j] = list(enc.ids)
        self._pieces = pieces
        self._piece_ids = self._piece_ids[:k] + [ids or [] for ids in new_ids]
        return [t for ids in self._piece_ids for t in ids]


#: The generation prompt of the reference ChatML rendering: the assistant turn's opening.
CHATML_GENERATION_PROMPT = "<|im_start|>assistant\n"


def chatml_message(role: str, content: str) -> str:
    """One message of the reference ChatML rendering.

    That is ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; a prompt is its
    messages' texts, then `CHATML_GENERATION_PROMPT`.
    """
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


def chatml_prompt_ids(
    tokenizer: ChatTokenizer | Tokenizer, messages: Sequence[ChatMessage]
) -> list[int]:
    """Ids of the reference ChatML prompt: the rendering behind the project's figures.

    Each message becomes ``<|im_start|>{role}\\n{content}<|im_end|>\\n``, then
    ``<|im_start|>assistant\\n`` follows; the text is encoded with
    ``add_special_tokens=False``.  ``tokenizer`` is a `ChatTokenizer` or a
    ``tokenizers.Tokenizer`` that has ``<|im_start|>`` and ``<|im_end|>`` as
    added tokens (else `InvalidArgumentError`).  Same as
    ``ChatTokenizer(tok, CHATML_TEMPLATE).prompt_ids(messages)``.
    """
    tok = tokenizer.tokenizer if isinstance(tokenizer, ChatTokenizer) else tokenizer
    if not isinstance(tok, Tokenizer):
        raise TypeError(f"expected a ChatTokenizer or tokenizers.Tokenizer, got {type(tokenizer)}")
    if tok.token_to_id("<|im_start|>") is None or tok.token_to_id("<|im_end|>") is None:
        raise InvalidArgumentError("tokenizer has no <|im_start|>/<|im_end|> tokens (not ChatML)")
    chat = _template_messages(messages)
    parts: list[str] = []
    for i, m in enumerate(chat):
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            raise TypeError(f"messages[{i}] needs string 'role' and 'content'")
        parts.append(chatml_message(role, content))
    parts.append(CHATML_GENERATION_PROMPT)
    return list(tok.encode("".join(parts), add_special_tokens=False).ids)
