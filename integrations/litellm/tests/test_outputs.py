"""Reading token ids and text out of LiteLLM answers and stream chunks."""

from __future__ import annotations

from litellm.types.utils import ModelResponse, ModelResponseStream

from agentspec_litellm.outputs import StreamAccumulator, response_outputs, strip_token_ids


def answer() -> ModelResponse:
    return ModelResponse(
        id="c1",
        model="m",
        choices=[
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"role": "assistant", "content": "hi"},
                "provider_specific_fields": {"token_ids": [5, 6]},
            }
        ],
        prompt_token_ids=[1, 2, 3],
    )


def test_non_streamed_answer_ids_text_and_stripping() -> None:
    resp = answer()
    out = response_outputs(resp)
    assert (out.prompt_ids, out.token_ids, out.texts) == ([1, 2, 3], [[5, 6]], ["hi"])
    strip_token_ids(resp)
    again = response_outputs(resp)
    assert again.prompt_ids is None
    assert again.token_ids == [None]
    assert again.texts == ["hi"]


def test_tool_calls_count_as_text() -> None:
    out = response_outputs(
        {
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "content": None,
                        "tool_calls": [{"function": {"name": "bash", "arguments": '{"c":1}'}}],
                    },
                }
            ]
        }
    )
    assert out.token_ids == [None]
    assert '"name": "bash"' in out.texts[0]


def chunk(**choice: object) -> ModelResponseStream:
    return ModelResponseStream(id="c1", model="m", choices=[{"index": 0, **choice}])


def test_stream_accumulates_ids_until_finished() -> None:
    acc = StreamAccumulator()
    acc.add(chunk(delta={"role": "assistant", "content": ""}, token_ids=[]))
    acc.add(chunk(delta={"content": "Hel"}, token_ids=[10]))
    assert not acc.finished
    acc.add(chunk(delta={"content": "lo"}, token_ids=[11]))
    acc.add(chunk(delta={}, finish_reason="stop"))
    assert acc.finished
    out = acc.outputs()
    assert out.token_ids == [[10, 11]]
    assert out.texts == ["Hello"]


def test_a_chunk_without_ids_makes_the_choice_text_only() -> None:
    acc = StreamAccumulator()
    acc.add(chunk(delta={"content": "a"}, token_ids=[1]))
    acc.add(chunk(delta={"content": "b"}))  # ids missing: the id list would be incomplete
    acc.add(chunk(delta={}, finish_reason="stop"))
    assert acc.outputs().token_ids == [None]
    assert acc.outputs().texts == ["ab"]
