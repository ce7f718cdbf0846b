"""The OpenAI-compatible routes in front of a real tritonserver serving the demo bundle, with the `openai` client:
greedy answers are Pipeline.generate's, streamed or whole, through a chat template or not; stop strings cut the text
and end the request; seeded sampling is reproducible; bad requests get OpenAI errors naming their field; a client
that leaves mid-stream frees its place. Skipped, saying why, only where the server files cannot be installed."""

import pytest

pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] (a dev dependency) is the gRPC client")
openai = pytest.importorskip("openai", reason="the openai client (a dev dependency) is what OpenAI users run")

from tests.serving.triton_helpers import metrics, quiet, start_server  # noqa: E402

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NAME = "demo"


@pytest.fixture(scope="module")
def triton(files, demo_bundle, tmp_path_factory):
    from specrt.serving.triton import TritonConfig, write_repository

    root = tmp_path_factory.mktemp("openai")
    write_repository(TritonConfig(bundle=demo_bundle, out=root / "repo", method="sd", threads=2, max_batch=8))
    server = start_server(files, root / "repo", root)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "chatml.jinja"
    path.write_text(CHATML)
    return path


def served(triton, demo_bundle, template=None):
    from specrt.serving.openai_server import Served

    return Served(NAME, triton.grpc_url, "sd", demo_bundle / "tokenizer", template)


@pytest.fixture(scope="module")
def api(triton, demo_bundle, template):
    from specrt.serving.openai_server import OpenAIServer
    from specrt.serving.tritonserver import free_ports

    server = OpenAIServer(served(triton, demo_bundle, template), "127.0.0.1", free_ports(1)[0]).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(api):
    return openai.OpenAI(base_url=api.url, api_key="-", max_retries=0)


def test_the_served_model_is_listed(client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.models.retrieve(NAME).owned_by == "specrt"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_a_greedy_completion_is_the_pipelines_and_says_what_it_took(client, pipelines, humaneval):
    pipe = pipelines["ort"]
    for p in humaneval[:3]:
        want = pipe.generate(p, method="sd", max_new_tokens=24)
        got = client.completions.create(model=NAME, prompt=p, max_tokens=24, temperature=0,
                                        extra_body={"return_token_ids": True})
        assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"
        assert got.choices[0].model_extra["token_ids"] == want.token_ids
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(pipe.encode(p)), 24)
        spec = got.model_extra["speculation"]
        assert spec["method"] == "sd" and spec["target_steps"] == want.stats.rounds
        assert spec["tokens_per_target_call"] == round(24 / want.stats.rounds, 3) > 1  # the demo draft is accepted


def test_a_streamed_completion_adds_up_to_the_same_text(client, pipelines, humaneval):
    want = pipelines["ort"].generate(humaneval[3], method="anpd", max_new_tokens=32)
    chunks = list(client.completions.create(model=NAME, prompt=humaneval[3], max_tokens=32, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"method": "anpd", "return_token_ids": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) >= 2 and "".join(texts) == want.text
    assert [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]] == want.token_ids
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 32


def test_a_stop_string_cuts_the_text_and_ends_the_request(client, pipelines, humaneval, triton):
    whole = pipelines["ort"].generate(humaneval[4], method="sd", max_new_tokens=64).text
    stop = whole[30:34]
    cut = whole.index(stop)
    for stream in (False, True):
        got = client.completions.create(model=NAME, prompt=humaneval[4], max_tokens=64, temperature=0, stop=[stop],
                                        stream=stream)
        if stream:
            chunks = list(got)
            text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, finish = got.choices[0].text, got.choices[0].finish_reason
            assert got.usage.completion_tokens < 64
        assert (text, finish) == (whole[:cut], "stop")
    assert not quiet(triton)['specrt_running_sequences{method="sd"}']


def test_a_chat_goes_through_the_chat_template(client, pipelines, template):
    from specrt.chat import ChatTemplate

    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    prompt = ChatTemplate(CHATML, str(template)).render(messages)
    want = pipelines["ort"].generate(prompt, method="sd", max_new_tokens=20).text
    got = client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0)
    assert got.choices[0].message.content == want and got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(pipelines["ort"].encode(prompt))
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=20, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_seeded_sampled_request_is_what_generate_samples_with_that_seed(client, pipelines, humaneval):
    want = pipelines["ort"].generate(humaneval[5], method="sd", max_new_tokens=16, temperature=0.8, seed=11).text
    for _ in range(2):
        got = client.completions.create(model=NAME, prompt=humaneval[5], max_tokens=16, temperature=0.8, seed=11)
        assert got.choices[0].text == want


@pytest.mark.parametrize("kwargs,status,param", [
    (dict(model="other"), 404, "model"),
    (dict(n=2), 400, "n"),
    (dict(extra_body={"method": "bogus"}), 400, "method"),
    (dict(max_tokens=100000), 400, "prompt,max_tokens"),  # past the context
    (dict(max_tokens=0), 400, "max_tokens"),
    (dict(temperature=-0.5), 400, "temperature"),
    (dict(logprobs=1), 400, "logprobs"),
    (dict(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    (dict(messages=[{"role": "user"}]), 400, "messages"),  # malformed: no content
    (dict(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages"),
])
def test_a_bad_request_is_an_openai_error_naming_its_field_and_the_next_is_answered(client, pipelines, humaneval, kwargs,
                                                                                    status, param):
    request = {"model": NAME, "max_tokens": 8, **kwargs}
    create = client.chat.completions.create if "messages" in request else client.completions.create
    with pytest.raises(openai.APIStatusError) as e:
        create(**request) if "messages" in request else create(prompt=humaneval[0], **request)
    assert e.value.status_code == status and e.value.body["param"] == param and e.value.body["message"]
    want = pipelines["ort"].generate(humaneval[1], method="sd", max_new_tokens=8).text
    assert client.completions.create(model=NAME, prompt=humaneval[1], max_tokens=8, temperature=0).choices[0].text == want


def test_a_body_that_is_not_utf8_json_is_refused(api):
    import json
    import urllib.error
    import urllib.request

    for body in (b'{"model": "demo", "prompt": "' + bytes([0xFF, 0xFE]) + b'"}', b"{not json"):
        request = urllib.request.Request(f"{api.url}/completions", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=30)
        assert e.value.code == 400 and json.loads(e.value.read())["error"]["type"] == "invalid_request_error"


def test_sixteen_streaming_clients_at_once_all_get_their_text(client, pipelines, humaneval):
    from concurrent.futures import ThreadPoolExecutor

    want = [pipelines["ort"].generate(p, method="sd", max_new_tokens=24).text for p in humaneval[:8]]

    def one(i):
        chunks = client.completions.create(model=NAME, prompt=humaneval[i % 8], max_tokens=24, temperature=0,
                                           stream=True)
        return "".join(c.choices[0].text for c in chunks)

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(one, range(16))) == [want[i % 8] for i in range(16)]


def test_without_a_chat_template_chat_is_refused_and_completions_still_answer(triton, demo_bundle, humaneval):
    from fastapi.testclient import TestClient

    from specrt.serving.openai_server import make_app

    with TestClient(make_app(served(triton, demo_bundle))) as http:
        r = http.post("/v1/chat/completions", json={"model": NAME, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "no_chat_template"
        assert "--chat-template" in r.json()["error"]["message"]
        r = http.post("/v1/completions", content=b"{not json")
        assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"model": NAME, "prompt": humaneval[0], "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert http.get("/health").json() == {"status": "ok"}


def test_a_server_that_cannot_be_reached_is_a_503_saying_so():
    """Nothing listens where the decode loop should: a 503 that says so, at once (not the wait for a stub's death)."""
    import time
    from pathlib import Path

    from fastapi.testclient import TestClient

    from specrt.serving.openai_server import Served, make_app
    from specrt.serving.tritonserver import free_ports

    tokenizer = Path(__file__).resolve().parents[2] / "specrt" / "checkpoints" / "demo" / "tokenizer"
    with TestClient(make_app(Served(NAME, f"127.0.0.1:{free_ports(1)[0]}", "sd", tokenizer))) as http:
        t0 = time.monotonic()
        r = http.post("/v1/completions", json={"model": NAME, "prompt": "def f(x):", "max_tokens": 4})
        assert r.status_code == 503 and "the Triton server cannot be reached" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 2


def test_a_client_that_leaves_mid_stream_frees_its_place(client, triton, humaneval):
    before = quiet(triton)
    stream = client.completions.create(model=NAME, prompt=humaneval[6], max_tokens=1500, temperature=0, stream=True,
                                       extra_body={"method": "autoregressive"})
    assert next(iter(stream)).choices[0].text
    stream.close()  # gone midway
    after = quiet(triton)  # the request left its batch: nothing runs, far from its 1500 tokens
    key = 'specrt_generated_tokens_total{method="autoregressive"}'
    assert 0 < after[key] - before.get(key, 0) < 1500
    assert not metrics(triton)['specrt_running_sequences{method="autoregressive"}']


def test_a_killed_stub_is_reloaded_and_readiness_says_so_meanwhile(client, api, triton, pipelines, humaneval):
    """The decode loop's process killed, as the OOM killer would, a request in flight: readiness false within 5 s, the
    request ends with a 503 event, and the next requests are answered again, by themselves, within 60 s. Three times:
    whether Triton still counts the old model ready when the load comes (it then loads in the background, ready all
    along) is a race. Then the server's own process is killed, and started again (runs last: the model is reloaded and
    the server restarted)."""
    import os
    import signal
    import threading
    import time

    from specrt.serving.serve import Revive

    revive = Revive(triton, interval=0.2)
    revive.on_death.append(api.fail_in_flight)
    revive.start()
    try:
        for n in range(1, 4):
            stream = iter(client.completions.create(model=NAME, prompt=humaneval[7], max_tokens=1900, temperature=0,
                                                    stream=True, extra_body={"method": "autoregressive"}))
            assert next(stream).choices[0].text
            (stub,) = triton.stubs("specrt")
            os.kill(stub, signal.SIGKILL)
            killed, unready = time.monotonic(), []

            def watch():  # from the kill on: the first moment readiness says false
                while not unready and time.monotonic() < killed + 30:
                    if not triton.ready():
                        unready.append(time.monotonic() - killed)
                    time.sleep(0.02)

            watcher = threading.Thread(target=watch)
            watcher.start()
            restarts = revive.restarts
            with pytest.raises(openai.APIError) as lost:
                for _ in stream:
                    pass
            watcher.join()
            assert unready and unready[0] < 5, f"kill {n}: readiness stayed true over a dead stub"
            while not (triton.ready() and revive.revived >= n):  # counted once the reload (or a restart) returned
                assert time.monotonic() < killed + 60, f"kill {n}: not reloaded within 60 s"
                time.sleep(0.2)
            # a stub's death can crash the server with it (Triton's bug): its streams break before anyone knows why
            crashed = revive.restarts > restarts and "the Triton server cannot be reached" in str(lost.value)
            assert "process died" in str(lost.value) or crashed, lost.value
            want = pipelines["ort"].generate(humaneval[0], method="sd", max_new_tokens=16).text
            got = client.completions.create(model=NAME, prompt=humaneval[0], max_tokens=16, temperature=0)
            assert got.choices[0].text == want
            assert triton.stubs("specrt") != [stub]
        # the server itself killed (Triton's Python backend can abort it as a stub dies): started again, on its ports
        stream = iter(client.completions.create(model=NAME, prompt=humaneval[7], max_tokens=1900, temperature=0,
                                                stream=True, extra_body={"method": "autoregressive"}))
        assert next(stream).choices[0].text
        old, killed, restarts = triton.process.pid, time.monotonic(), revive.restarts
        os.kill(old, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="process died|cannot be reached"):
            for _ in stream:
                pass
        while not (triton.ready() and revive.restarts > restarts):
            assert time.monotonic() < killed + 60, "the server was not started again within 60 s"
            time.sleep(0.2)
        got = client.completions.create(model=NAME, prompt=humaneval[0], max_tokens=16, temperature=0)
        assert got.choices[0].text == want and triton.process.pid != old
        assert revive.thread.is_alive() and revive.gave_up is None
    finally:
        revive.stop()
