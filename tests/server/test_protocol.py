"""The request bodies' own mapping to SamplingParams, without a server: every check, and the body untouched."""

import pytest

from acache.server.protocol import MAX_STOP_CHARS, MAX_STOPS, BadRequest, ChatCompletionRequest, CompletionRequest

CHAT = [{"role": "user", "content": "hi"}]


def test_max_completion_tokens_sets_the_budget_and_leaves_the_body_as_it_came():
    body = ChatCompletionRequest(messages=CHAT, max_completion_tokens=10)
    params = body.to_sampling_params(reuse=False)
    assert body.max_tokens is None and body.token_limit == 10
    assert params.gen_length % params.block_length == 0 and params.gen_length >= 10
    assert params == ChatCompletionRequest(messages=CHAT, max_tokens=10).to_sampling_params(reuse=False)


def test_max_tokens_and_max_completion_tokens_that_disagree_are_refused():
    body = ChatCompletionRequest(messages=CHAT, max_tokens=4, max_completion_tokens=8)
    with pytest.raises(BadRequest, match=r"max_tokens \(4\) and max_completion_tokens \(8\) disagree"):
        body.to_sampling_params(reuse=False)


def test_the_selector_applies_only_to_a_reused_affix():
    body = CompletionRequest(prompt="x", max_tokens=4)
    assert body.to_sampling_params(reuse=True, default_selector="cacheblend").selector == "cacheblend"
    assert body.to_sampling_params(reuse=False, default_selector="cacheblend").selector is None
    chosen = CompletionRequest(prompt="x", max_tokens=4, selector="random")
    assert chosen.to_sampling_params(reuse=True, default_selector="cacheblend").selector == "random"
    off = CompletionRequest(prompt="x", max_tokens=4, selector="off")
    assert off.to_sampling_params(reuse=True).selector is None


@pytest.mark.parametrize(("fields", "message"), [
    ({"selector": "nope"}, "selector must be one of"),
    ({"max_tokens": 0}, "max_tokens must be positive, got 0"),
    ({"n": 2}, "only n=1"),
    ({"stream_options": {"include_usage": True}}, "only allowed with stream=true"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options takes include_usage"),
    ({"anchor_ratio": 1.5}, "anchor_ratio"),
    ({"stop": [f"s{i}" for i in range(MAX_STOPS + 1)]},
     f"stop takes at most {MAX_STOPS} strings, got {MAX_STOPS + 1}"),
    ({"stop": "x" * (MAX_STOP_CHARS + 1)}, f"a stop string may have at most {MAX_STOP_CHARS} characters, got one of "
                                           "257"),
    ({"stop": ["ok", "y" * 300]}, "at most 256 characters, got one of 300"),
])
def test_each_bad_field_is_named(fields, message):
    body = CompletionRequest(prompt="x", **fields)
    before = body.model_dump()
    with pytest.raises(BadRequest, match=message):
        body.to_sampling_params(reuse=True)
    assert body.model_dump() == before


def test_empty_stop_strings_are_no_stops_and_count_toward_no_limit():
    body = CompletionRequest(prompt="x", max_tokens=4, stop=[""] * (MAX_STOPS + 1) + ["\n"])
    assert body.to_sampling_params(reuse=False).gen_length == 4
