"""Tests of agentspec.chat: chat-template rendering, prompt/response ids, incremental sessions.

They use the shipped Qwen3 and Llama 3 tokenizers and traces under ../shared
(tests/prereq.py: skipped without them, failed under CI).
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
from prereq import require_module, require_shared, requires_shared, shared

require_module("jinja2")
tokenizers = require_module("tokenizers")

from agentspec.chat import (  # noqa: E402
    CHATML_GENERATION_PROMPT,
    CHATML_TEMPLATE,
    ChatTemplateError,
    ChatTokenizer,
    SessionRenderer,
    chatml_message,
    chatml_prompt_ids,
)
from agentspec.exceptions import AgentSpecError, InvalidArgumentError  # noqa: E402
from agentspec.traces import Message, TraceRecord, read_traces  # noqa: E402

DATA = shared()
QWEN3 = DATA / "tokenizers" / "qwen3"
LLAMA3 = DATA / "tokenizers" / "llama3"
SPIDER = DATA / "traces" / "spider-sql.dev.jsonl.gz"
SWE = DATA / "traces" / "swe-gemini3pro.dev.jsonl.gz"

pytestmark = requires_shared(QWEN3, LLAMA3)

CONVERSATION = (
    Message("system", "You are terse."),
    Message("user", "  Hi there!\n"),
    Message("assistant", "Hello."),
    Message("user", "SELECT 1;"),
)


@pytest.fixture(scope="module")
def qwen3() -> ChatTokenizer:
    return ChatTokenizer.from_dir(QWEN3)


@pytest.fixture(scope="module")
def llama3() -> ChatTokenizer:
    return ChatTokenizer.from_dir(LLAMA3)


def _records(path: Path, n: int) -> list[TraceRecord]:
    require_shared(path)
    return list(read_traces(path, max_sessions=n))


def test_qwen3_two_messages_equal_hand_written_chatml(qwen3: ChatTokenizer) -> None:
    """Qwen3's template on system+user gives the ids of the hand-written ChatML text."""
    msgs = [Message("system", "You are terse."), Message("user", "Hi there!")]
    text = (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi there!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert qwen3.render(msgs) == text
    ids = qwen3.prompt_ids(msgs)
    assert ids == qwen3.tokenizer.encode(text, add_special_tokens=False).ids
    assert ids == chatml_prompt_ids(qwen3, msgs)
    im_start = qwen3.tokenizer.token_to_id("<|im_start|>")
    assert im_start is not None
    assert ids.count(im_start) == 3  # control tokens are single ids
    assert qwen3.tokenizer.decode(ids, skip_special_tokens=False) == text


def test_llama3_matches_hand_written_llama3_format(llama3: ChatTokenizer) -> None:
    """Llama 3's template: BOS once, header tokens, content trimmed, assistant header last."""
    text = (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nSELECT 1;<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert llama3.render(CONVERSATION) == text
    ids = llama3.prompt_ids(CONVERSATION)
    assert ids == llama3.tokenizer.encode(text, add_special_tokens=False).ids
    assert ids[0] == llama3.tokenizer.token_to_id("<|begin_of_text|>")
    assert ids.count(ids[0]) == 1


def test_qwen3_enable_thinking_is_passed_through(qwen3: ChatTokenizer) -> None:
    """enable_thinking=False adds the empty think block; None keeps the template default."""
    default = qwen3.render(CONVERSATION)
    assert default.endswith("<|im_start|>assistant\n")
    assert qwen3.render(CONVERSATION, enable_thinking=True) == default
    off = qwen3.render(CONVERSATION, enable_thinking=False)
    assert off == default + "<think>\n\n</think>\n\n"
    assert qwen3.prompt_ids(CONVERSATION, enable_thinking=False) == qwen3.encode(off)


def test_qwen3_rerenders_reasoning_of_history(qwen3: ChatTokenizer) -> None:
    """Qwen3 drops <think> blocks of earlier turns but keeps them after the last user turn."""
    think = Message("assistant", "<think>\nplan\n</think>\n\nanswer")
    early = qwen3.render([Message("user", "q"), think, Message("user", "next")])
    assert "<|im_start|>assistant\nanswer<|im_end|>" in early
    late = qwen3.render([Message("user", "q"), think])
    assert "<think>\nplan\n</think>\n\nanswer<|im_end|>" in late


def test_response_ids_and_eos(qwen3: ChatTokenizer, llama3: ChatTokenizer) -> None:
    """response_ids encodes the content alone; append_eos adds the config's EOS id."""
    text = "SELECT name FROM singer WHERE age > 30"
    plain = qwen3.response_ids(text)
    assert plain == qwen3.tokenizer.encode(text, add_special_tokens=False).ids
    assert qwen3.eos_token == "<|im_end|>"
    assert qwen3.eos_token_id == qwen3.tokenizer.token_to_id("<|im_end|>")
    assert qwen3.response_ids(text, append_eos=True) == [*plain, qwen3.eos_token_id]
    assert llama3.eos_token_id == llama3.tokenizer.token_to_id("<|end_of_text|>")
    assert llama3.response_ids(text)[0] != llama3.tokenizer.token_to_id("<|begin_of_text|>")
    assert qwen3.bos_token is None
    assert llama3.bos_token == "<|begin_of_text|>"


def test_response_ids_without_eos_token_refuses_append_eos(qwen3: ChatTokenizer) -> None:
    """append_eos=True on a tokenizer without an EOS token raises InvalidArgumentError."""
    bare = ChatTokenizer(qwen3.tokenizer, CHATML_TEMPLATE)
    assert bare.eos_token_id is None
    assert bare.response_ids("x") == qwen3.response_ids("x")
    with pytest.raises(InvalidArgumentError, match="no EOS"):
        bare.response_ids("x", append_eos=True)


@pytest.mark.parametrize(
    ("tok_name", "trace", "n"),
    [("qwen3", SPIDER, 50), ("llama3", SPIDER, 50)],
    ids=["qwen3-spider", "llama3-spider"],
)
def test_session_renderer_equals_whole_prompt_on_spider(
    request: pytest.FixtureRequest, tok_name: str, trace: Path, n: int
) -> None:
    """Incremental ids equal whole-prompt encoding for every request of 50 spider sessions."""
    chat: ChatTokenizer = request.getfixturevalue(tok_name)
    _check_sessions(chat, _records(trace, n))


@pytest.mark.slow
def test_session_renderer_equals_whole_prompt_on_swe(qwen3: ChatTokenizer) -> None:
    """Incremental ids equal whole-prompt encoding on 3 long agentic swe sessions (Qwen3)."""
    renderer = _check_sessions(qwen3, _records(SWE, 3))
    assert renderer.reused_chars > 10 * renderer.encoded_chars  # history is not re-encoded


def _check_sessions(chat: ChatTokenizer, records: list[TraceRecord]) -> SessionRenderer:
    renderer = chat.session()
    assert renderer.incremental
    checked = 0
    for rec in records:
        renderer.reset()
        for req in rec.requests():
            assert renderer.prompt_ids(req.prompt) == chat.prompt_ids(req.prompt), (
                rec.session,
                req.turn,
            )
            checked += 1
    assert checked >= len(records)
    return renderer


def test_session_renderer_handles_rerendered_history(qwen3: ChatTokenizer) -> None:
    """When the template renders earlier messages differently later, ids still match."""
    think = Message("assistant", "<think>\nplan\n</think>\n\nanswer")
    prompts = [
        [Message("user", "q")],
        [Message("user", "q"), think],  # think block kept: after the last user turn
        [Message("user", "q"), think, Message("user", "go on")],  # now dropped
        [Message("user", "q"), think, Message("user", "go on"), Message("assistant", "ok")],
    ]
    for thinking in (None, False):
        renderer = SessionRenderer(qwen3, enable_thinking=thinking)
        for p in prompts:
            assert renderer.prompt_ids(p) == qwen3.prompt_ids(p, enable_thinking=thinking)


@pytest.mark.parametrize("flag", ["lstrip", "rstrip", "single_word"])
def test_session_renderer_falls_back_when_pieces_are_not_exact(
    qwen3: ChatTokenizer, flag: str
) -> None:
    """A whitespace-stripping or whole-word added token forces whole-prompt encoding."""
    tok = tokenizers.Tokenizer.from_str(qwen3.tokenizer.to_str())
    tok.add_special_tokens([tokenizers.AddedToken("<|sep|>", **{flag: True})])
    chat = ChatTokenizer(tok, qwen3.chat_template, special_tokens=qwen3.special_tokens)
    renderer = chat.session()
    assert not renderer.incremental
    msgs = [Message("user", "a  <|sep|>  b"), Message("assistant", "c"), Message("user", "d")]
    assert renderer.prompt_ids(msgs[:1]) == chat.prompt_ids(msgs[:1])
    assert renderer.prompt_ids(msgs) == chat.prompt_ids(msgs)
    assert renderer.reused_chars == 0


def test_lstrip_token_really_breaks_piecewise_encoding(qwen3: ChatTokenizer) -> None:
    """Why the fallback exists: with an lstrip token, encoding split pieces changes the ids."""
    tok = tokenizers.Tokenizer.from_str(qwen3.tokenizer.to_str())
    tok.add_special_tokens([tokenizers.AddedToken("<|sep|>", lstrip=True)])
    whole = tok.encode("a  <|sep|>", add_special_tokens=False).ids
    pieces = [*tok.encode("a  ", add_special_tokens=False).ids, tok.token_to_id("<|sep|>")]
    assert whole != pieces


def test_chatml_prompt_ids_matches_qwen3_template_on_spider(qwen3: ChatTokenizer) -> None:
    """The reference ChatML ids equal Qwen3's own template on spider prompts."""
    for rec in _records(SPIDER, 20):
        for req in rec.requests():
            assert chatml_prompt_ids(qwen3, req.prompt) == qwen3.prompt_ids(req.prompt)
            assert chatml_prompt_ids(qwen3.tokenizer, req.prompt) == qwen3.prompt_ids(req.prompt)


def test_chatml_template_constant_equals_chatml_prompt_ids(qwen3: ChatTokenizer) -> None:
    """CHATML_TEMPLATE renders exactly what chatml_prompt_ids encodes, think blocks kept."""
    chat = ChatTokenizer(qwen3.tokenizer, CHATML_TEMPLATE)
    msgs = [Message("user", "q"), Message("assistant", "<think>x</think>y"), Message("user", "z")]
    assert chat.prompt_ids(msgs) == chatml_prompt_ids(qwen3, msgs)
    assert chat.session().prompt_ids(msgs) == chatml_prompt_ids(qwen3, msgs)
    text = "".join(chatml_message(m.role, m.content) for m in msgs) + CHATML_GENERATION_PROMPT
    assert chat.render(msgs) == text


def test_chatml_prompt_ids_needs_chatml_tokens(llama3: ChatTokenizer) -> None:
    """A tokenizer without <|im_start|>/<|im_end|> raises InvalidArgumentError."""
    with pytest.raises(InvalidArgumentError, match="im_start"):
        chatml_prompt_ids(llama3, CONVERSATION)
    with pytest.raises(TypeError):
        chatml_prompt_ids("qwen3", CONVERSATION)  # type: ignore[arg-type]


def test_mappings_are_accepted_like_messages(qwen3: ChatTokenizer) -> None:
    """role/content dicts render like Message objects; a message's stage is not rendered."""
    dicts = [{"role": m.role, "content": m.content} for m in CONVERSATION]
    assert qwen3.render(dicts) == qwen3.render(CONVERSATION)
    staged = [Message(m.role, m.content, stage="x") for m in CONVERSATION]
    assert qwen3.render(staged) == qwen3.render(CONVERSATION)


def test_bad_inputs_raise_clear_errors(qwen3: ChatTokenizer) -> None:
    """Empty conversations, non-messages and reserved keywords raise typed errors."""
    with pytest.raises(InvalidArgumentError, match="empty conversation"):
        qwen3.prompt_ids([])
    with pytest.raises(TypeError, match="messages must be a sequence"):
        qwen3.prompt_ids("hello")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"messages\[0\]"):
        qwen3.prompt_ids([42])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="cannot be passed"):
        qwen3.prompt_ids([{"role": "user", "content": object()}])
    with pytest.raises(TypeError, match=r"tokenizers\.Tokenizer"):
        ChatTokenizer("tok", CHATML_TEMPLATE)  # type: ignore[arg-type]


def _custom(qwen3: ChatTokenizer, template: str) -> ChatTokenizer:
    return ChatTokenizer(qwen3.tokenizer, template, special_tokens={"eos_token": "<|im_end|>"})


def test_template_errors_become_chat_template_errors(qwen3: ChatTokenizer) -> None:
    """Syntax errors, raise_exception and sandbox violations raise ChatTemplateError."""
    assert issubclass(ChatTemplateError, AgentSpecError)
    assert issubclass(ChatTemplateError, ValueError)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        _custom(qwen3, "{% for m in messages %}")
    failing = _custom(qwen3, "{{ raise_exception('only user turns, got ' + messages[0].role) }}")
    with pytest.raises(ChatTemplateError, match="only user turns, got system"):
        failing.render(CONVERSATION)
    escape = _custom(qwen3, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        escape.render(CONVERSATION)
    ns = _custom(qwen3, "{% set ns = namespace(_x=1) %}{{ ns._x }}")
    with pytest.raises(ChatTemplateError, match="underscore"):
        ns.render(CONVERSATION)
    with pytest.raises(ChatTemplateError, match="non-empty"):
        ChatTokenizer(qwen3.tokenizer, "")


def test_template_helpers_match_transformers(qwen3: ChatTokenizer) -> None:
    """tojson keeps non-ASCII, strftime_now formats now, {% generation %} and break work."""
    chat = _custom(
        qwen3,
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}\n\n{% endfor %}"
        "{{ strftime_now('%Y') }}#{{ eos_token }}#{{ add_generation_prompt }}"
        "{{ dict.fromkeys(['k']) | tojson(sort_keys=true) }}",
    )
    before = datetime.datetime.now().year
    out = chat.render([Message("user", "é"), Message("assistant", "<b>"), Message("user", "z")])
    after = datetime.datetime.now().year
    lines = out.split("\n")
    assert lines[0] == '{"role": "user", "content": "é"}'
    assert lines[1] == '{"role": "assistant", "content": "<b>"}'
    year, eos, gen = lines[2].split("#")
    assert int(year) in (before, after)
    assert eos == "<|im_end|>"
    assert gen == 'True{"k": null}'


def test_from_dir_template_sources(tmp_path: Path, qwen3: ChatTokenizer) -> None:
    """chat_template.jinja wins over the config; a list of named templates uses 'default'."""
    (tmp_path / "tokenizer.json").symlink_to(QWEN3 / "tokenizer.json")
    config = json.loads((QWEN3 / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "DEFAULT {{ messages | length }}"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTokenizer.from_dir(tmp_path).render(CONVERSATION) == "DEFAULT 4"
    (tmp_path / "chat_template.jinja").write_text("FILE {{ eos_token }}")
    assert ChatTokenizer.from_dir(tmp_path).render(CONVERSATION) == "FILE <|im_end|>"


def test_from_dir_missing_pieces(tmp_path: Path) -> None:
    """Missing files raise FileNotFoundError; a config without a template, ChatTemplateError."""
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        ChatTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").symlink_to(QWEN3 / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ChatTemplateError, match="not valid JSON"):
        ChatTokenizer.from_dir(tmp_path)
