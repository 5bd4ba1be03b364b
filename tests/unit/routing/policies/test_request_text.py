"""routing.policies.request_text: the prompt text of a chat, completion or other body, as the
prefix-matching policies read it."""

from __future__ import annotations

from typing import Any

from routing.policies.request_text import request_text


def test_chat_text_has_roles_and_contents_in_order() -> None:
    text = request_text(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello there"},
            ]
        }
    )
    assert text == "system\x1fBe brief.\x1euser\x1fHello there"
    swapped = request_text(
        {"messages": [{"role": "user", "content": "Be brief."}, {"role": "system", "content": "x"}]}
    )
    assert swapped != text


def test_chat_text_is_prefix_preserving_across_turns() -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "one"}]
    first = request_text({"messages": messages})
    messages += [{"role": "assistant", "content": "two"}, {"role": "user", "content": "three"}]
    assert request_text({"messages": messages}).startswith(first)


def test_chat_parts_keep_text_and_mark_images() -> None:
    def body(url: str) -> dict[str, Any]:
        return {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is in"},
                        {"type": "image_url", "image_url": {"url": url}},
                        {"type": "text", "text": "this picture?"},
                    ],
                }
            ]
        }

    text = request_text(body("https://example.com/cat.png"))
    assert text == "user\x1fWhat is in\x1e<image_url:https://example.com/cat.png>\x1ethis picture?"
    assert request_text(body("https://example.com/dog.png")) != text
    # A big data URL is shortened but two different images still differ; the same is equal.
    cat = "data:image/png;base64," + "A" * 5000 + "cat"
    dog = "data:image/png;base64," + "A" * 5000 + "dog"
    assert len(request_text(body(cat))) < 200
    assert request_text(body(cat)) != request_text(body(dog))
    assert request_text(body(cat)) == request_text(body("".join(list(cat))))
    # The part's own string form of an image_url works too.
    short = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]}
    assert request_text(short) == "user\x1f<image_url:u>"


def test_chat_oddities_do_not_raise() -> None:
    body: dict[str, Any] = {
        "system": "Anthropic system",
        "messages": [
            "not a message",
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
                ],
            },
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "QUJD"}}]},
            {"content": 5},
        ],
    }
    text = request_text(body)
    assert text.startswith("system\x1fAnthropic system\x1e")
    assert 'f({"x": 1})' in text
    assert "<input_audio:QUJD>" in text


def test_completion_prompts() -> None:
    assert request_text({"prompt": "Once upon a time"}) == "Once upon a time"
    assert request_text({"prompt": ["Once upon", "a time"]}) == "Once upon\x1ea time"
    assert request_text({"prompt": [1, 22, 333]}) == "1 22 333"
    assert request_text({"prompt": [[1, 2], [3]]}) == "1 2\x1e3"
    assert request_text({"prompt": [1, 2]}) != request_text({"prompt": [12]})
    assert request_text({"prompt": ""}) == ""
    assert request_text({"prompt": []}) == ""


def test_other_bodies() -> None:
    assert request_text({"input": "embed me"}) == "embed me"
    assert request_text({"input": ["a", "b"]}) == "a\x1eb"
    responses = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}
    assert request_text(responses) == "user\x1fhi"
    assert request_text({**responses, "instructions": "Be kind."}) == (
        "system\x1fBe kind.\x1euser\x1fhi"
    )
    assert request_text({}) == ""
    assert request_text({"model": "m", "prompt": 7}) == ""
