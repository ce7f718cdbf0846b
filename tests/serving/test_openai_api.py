"""The OpenAI API's side of the server, without one: requests read and refused field by field, stop strings cut across
pieces, tokens counted up to a stop, and refusals of the decode loop turned into OpenAI errors naming their field."""

import pytest

from specrt.serving.openai_api import ApiError, StopText, read_request, served_error, tokens_through

BASE = {"model": "m", "prompt": "def f():"}


def test_a_request_becomes_the_decode_loops_inputs():
    req = read_request({**BASE, "max_tokens": 7, "temperature": 0, "seed": 3, "stop": "\n\n", "method": "anpd",
                        "user": "ignored", "n": 1, "logprobs": None, "stream": True,
                        "stream_options": {"include_usage": True}}, chat=False, model="m")
    assert req.inputs == {"TEMPERATURE": 0.0, "TOP_P": 1.0, "MAX_NEW_TOKENS": 7, "SEED": 3, "METHOD": "anpd"}
    assert (req.stop, req.stream, req.include_usage, req.prompt) == (("\n\n",), True, True, "def f():")
    assert read_request(BASE, chat=False, model="m").inputs == {"TEMPERATURE": 1.0, "TOP_P": 1.0, "MAX_NEW_TOKENS": 16}
    chat = read_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5},
                        chat=True, model="m")
    assert chat.inputs["MAX_NEW_TOKENS"] == 5 and "MAX_NEW_TOKENS" not in read_request(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, chat=True, model="m").inputs


@pytest.mark.parametrize("change,param,status", [
    ({"model": "other"}, "model", 404),
    ({"model": None}, "model", 400),
    ({"n": 2}, "n", 400),
    ({"prompt": ["a", "b"]}, "prompt", 400),
    ({"prompt": [1, 2, 3]}, "prompt", 400),
    ({"max_tokens": 0}, "max_tokens", 400),
    ({"max_tokens": 2.5}, "max_tokens", 400),
    ({"temperature": 2.5}, "temperature", 400),
    ({"temperature": "hot"}, "temperature", 400),
    ({"top_p": 0}, "top_p", 400),
    ({"seed": True}, "seed", 400),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", 400),
    ({"stop": [""]}, "stop", 400),
    ({"stream": "yes"}, "stream", 400),
    ({"stream_options": {"include_usage": True}}, "stream_options", 400),
    ({"logprobs": 2}, "logprobs", 400),
    ({"echo": True}, "echo", 400),
    ({"best_of": 3}, "best_of", 400),
    ({"presence_penalty": 0.5}, "presence_penalty", 400),
    ({"logit_bias": {"1": 5}}, "logit_bias", 400),
    ({"method": 3}, "method", 400),
])
def test_a_bad_field_is_refused_by_name(change, param, status):
    with pytest.raises(ApiError) as e:
        read_request({**BASE, **change}, chat=False, model="m")
    assert (e.value.status, e.value.param) == (status, param)
    assert e.value.body()["error"]["param"] == param and e.value.body()["error"]["message"]


def test_a_chat_request_needs_messages():
    for messages in (None, [], "hi"):
        with pytest.raises(ApiError, match="messages") as e:
            read_request({"model": "m", "messages": messages}, chat=True, model="m")
        assert e.value.param == "messages"


@pytest.mark.parametrize("pieces,stops,sent,hit", [
    (["Hello wor", "ld. Bye"], ("world",), "Hello ", "world"),  # across pieces: nothing of it goes out
    (["a\n", "\nb"], ("\n\n",), "a", "\n\n"),
    (["abc", "def"], ("x",), "abcdef", None),
    (["ab", "c"], ("bd", "c"), "ab", "c"),  # "b" held (it may begin "bd"), then sent when "c" proves otherwise
    (["one two", " three"], ("two", "one"), "", "one"),  # the first to appear wins
])
def test_stop_strings_cut_the_text_and_nothing_past_them_goes_out(pieces, stops, sent, hit):
    stop, out = StopText(stops), []
    for i, p in enumerate(pieces):
        out.append(stop.add(p, final=i == len(pieces) - 1))
    assert "".join(out) == sent and stop.hit == hit


def test_a_held_tail_goes_out_at_the_end():
    stop = StopText(("END",))
    assert stop.add("text E") == "text " and stop.add("N", final=True) == "EN" and stop.hit is None


def test_the_tokens_counted_are_those_up_to_the_stop():
    texts = {(): "", (1,): "ab", (1, 2): "abcd", (1, 2, 3): "abcdef"}
    decode = lambda ids: texts[tuple(ids)]  # noqa: E731
    assert [tokens_through(decode, [1, 2, 3], end) for end in (0, 1, 2, 3, 5, 6)] == [0, 1, 1, 2, 3, 3]


def test_the_decode_loops_refusals_name_the_request_field():
    assert served_error("METHOD: unknown method 'x' (choose from sd)", chat=False).param == "method"
    e = served_error("PROMPT, MAX_NEW_TOKENS: prompt 0 has 9000 tokens; ...", chat=True)
    assert (e.status, e.param) == (400, "messages,max_tokens")
    assert served_error("MAX_NEW_TOKENS must be int, got 2.5", chat=False).param == "max_tokens"
    failed = served_error("decoding failed: out of memory", chat=False)
    assert (failed.status, failed.kind) == (500, "server_error")
    for meanwhile in ("Stub process 'specrt_0_0' is not healthy.",
                      "Request for unknown model: 'specrt' has no available versions"):
        assert served_error(meanwhile, chat=False).status == 503  # a reload under way: send it again
