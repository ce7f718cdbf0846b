"""`specrt serve`: a real Triton Inference Server (the nvidia-pytriton wheel's tritonserver 2.51, installed into
build/tritonserver on first use) serving the demo bundle on 127.0.0.1, with real clients: gRPC streaming
(tritonclient) and the HTTP generate endpoint (a JSON body). Skipped, saying why, only where the server files cannot
be installed; CI requires them (SPECRT_REQUIRE_TRITON=1)."""

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] (a dev dependency) is the gRPC client")

from tests.serving.triton_helpers import ROOT, quiet, settled, start_server  # noqa: E402

# every lossless method a bundle without a plan (auto) or prompt tokens (ppd) runs
METHODS = ("autoregressive", "sd", "tree", "anpd", "dynamic")


@pytest.fixture(scope="module")
def repo(demo_bundle, tmp_path_factory):
    from specrt.serving.triton import TritonConfig, write_repository

    out = tmp_path_factory.mktemp("serve") / "repo"
    write_repository(TritonConfig(bundle=demo_bundle, out=out, method="sd", threads=2, max_batch=8))
    return out


@pytest.fixture(scope="module")
def server(files, repo, tmp_path_factory):
    s = start_server(files, repo, tmp_path_factory.mktemp("log"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(pipelines, humaneval):
    """Greedy tokens of Pipeline.generate, each prompt alone: what every served answer must equal."""
    out = {}
    for method in METHODS:
        for i, p in enumerate(humaneval[:8]):
            out[method, i] = pipelines["ort"].generate(p, method=method, max_new_tokens=24).token_ids
    return out


def test_served_greedy_tokens_equal_in_process_generation(server, humaneval, reference):
    from specrt.serving.client import GrpcStream, HttpClient, http_generate, joined

    for method in METHODS:
        assert reference[method, 0] == reference["autoregressive", 0]  # lossless: the reference is one
        with GrpcStream(server.grpc_url) as s, HttpClient(server.http_url) as http:
            for i, p in enumerate(humaneval[:8]):
                events = list(http.stream(p, MAX_NEW_TOKENS=24, METHOD=method))  # one kept-alive connection
                assert joined(events)["TOKEN_IDS"] == reference[method, i] and events[-1]["FINISH_REASON"] == "length"
                streamed = list(s.generate(p, MAX_NEW_TOKENS=24, METHOD=method, STREAM=True))
                assert len(streamed) >= 2 and streamed[-1]["final"] and streamed[-1]["FINISH_REASON"] == "length"
                assert joined(streamed)["TOKEN_IDS"] == reference[method, i], (method, i)
                whole = http_generate(server.http_url, p, MAX_NEW_TOKENS=24, METHOD=method)
                assert whole["TOKEN_IDS"] == reference[method, i] and whole["FINISH_REASON"] == "length"
                assert whole["TEXT"] == joined(streamed)["TEXT"]


def test_ppd_is_served_token_identical_too(files, ppd_bundle, humaneval, tmp_path):
    """PPD (the target guessing for itself through its trained prompt tokens), on a bundle that has them."""
    from specrt.runtime.pipeline import Pipeline
    from specrt.serving.client import HttpClient, joined
    from specrt.serving.triton import TritonConfig, write_repository

    write_repository(TritonConfig(bundle=ppd_bundle, out=tmp_path / "repo", method="ppd", threads=2))
    pipe = Pipeline.load(ppd_bundle, threads=2)
    server = start_server(files, tmp_path / "repo", tmp_path)
    try:
        with HttpClient(server.http_url) as http:
            for p in humaneval[:4]:
                want = pipe.generate(p, method="autoregressive", max_new_tokens=24).token_ids
                assert pipe.generate(p, method="ppd", max_new_tokens=24).token_ids == want
                assert joined(http.stream(p, MAX_NEW_TOKENS=24))["TOKEN_IDS"] == want  # ppd: the model's default
    finally:
        server.stop()


def test_the_served_model_loads_the_bundle_with_every_option_it_was_given(files, inplace_bundle, humaneval, tmp_path):
    """A model loaded with the in-graph KV update and without packed rows (the single-stream deployment of
    docs/benchmarks.md) serves what Pipeline.load with the same options generates; a plan tuned for those options is
    only valid for a pipeline loaded with them, so the options must reach the served model."""
    from specrt.runtime.pipeline import Pipeline
    from specrt.serving.client import http_generate
    from specrt.serving.triton import TritonConfig, write_repository

    options = {"threads": 2, "kv_update": "inplace", "packed_rows": False}
    write_repository(TritonConfig(bundle=inplace_bundle, out=tmp_path / "repo", method="sd", **options))
    pipe = Pipeline.load(inplace_bundle, **options)
    server = start_server(files, tmp_path / "repo", tmp_path)
    try:
        for p in humaneval[:3]:
            want = pipe.generate(p, method="autoregressive", max_new_tokens=24).token_ids
            assert http_generate(server.http_url, p, MAX_NEW_TOKENS=24)["TOKEN_IDS"] == want
    finally:
        server.stop()
    # the tokens are the same with either KV update (lossless): what the model loaded is in the line it logs
    assert f"specrt: {inplace_bundle.resolve()} loaded on {pipe.machine.describe()}" in (tmp_path / "server.log").read_text()


def test_a_seeded_sampled_request_is_what_generate_samples_with_that_seed(server, pipelines, humaneval):
    from specrt.serving.client import http_generate

    want = pipelines["ort"].generate(humaneval[3], method="sd", max_new_tokens=24, temperature=0.8, seed=7).token_ids
    got = http_generate(server.http_url, humaneval[3], MAX_NEW_TOKENS=24, TEMPERATURE=0.8, SEED=7)["TOKEN_IDS"]
    assert got == want


def test_concurrent_clients_share_batches_and_all_get_their_tokens(server, humaneval, reference):
    from specrt.serving.client import GrpcStream, joined

    before = quiet(server)
    answers, errors = {}, []

    def client(c):
        try:
            with GrpcStream(server.grpc_url) as s:
                for k in range(4):
                    i = (c + k) % 8
                    answers[c, k] = (i, joined(s.generate(humaneval[i], MAX_NEW_TOKENS=24, STREAM=True)))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors and len(answers) == 64
    assert all(a["TOKEN_IDS"] == reference["sd", i] for i, a in answers.values())
    key = 'specrt_generated_tokens_total{method="sd"}'
    after = settled(server, before, key, 64 * 24)
    assert after[key] - before.get(key, 0) == 64 * 24
    rounds = {k: after[k] - before.get(k, 0) for k in after if k.startswith('specrt_rounds_total{method="sd"')}
    several = sum(v for k, v in rounds.items() if 'sequences="1"' not in k)
    assert several > 0, rounds  # rounds held several sequences: the requests were batched together


@pytest.mark.parametrize("body,match", [
    ({"MAX_NEW_TOKENS": 4}, "the request has no PROMPT"),
    ({"PROMPT": "x", "MAX_NEW_TOKENS": 0}, "MAX_NEW_TOKENS: max_new_tokens must be an integer >= 1, got 0"),
    ({"PROMPT": "x", "MAX_NEW_TOKENS": -3}, "MAX_NEW_TOKENS: max_new_tokens must be an integer >= 1, got -3"),
    ({"PROMPT": "x", "MAX_NEW_TOKENS": 2**31 - 1}, "PROMPT, MAX_NEW_TOKENS: prompt 0 has 1 tokens; with "
                                                    "max_new_tokens=2147483647"),
    ({"PROMPT": "x", "METHOD": "beam"}, "METHOD: unknown method 'beam'"),
    ({"PROMPT": "x", "TEMPERATURE": -1}, "TEMPERATURE: temperature must be a finite number >= 0"),
    ({"PROMPT": "x", "SEED": -1}, "SEED: seed must be an integer >= 0, got -1"),
    ({"PROMPT": "", "MAX_NEW_TOKENS": 4}, "PROMPT: empty prompt"),
    # refused by Triton's own JSON parsing, before the model sees it (its message names no input)
    ({"PROMPT": "x", "MAX_NEW_TOKENS": "ten"}, "Unable to parse 'data': attempt to access JSON non-signed-integer"),
])
def test_a_bad_request_is_an_error_naming_its_input_and_the_server_goes_on(server, humaneval, reference, body, match):
    import re

    from specrt.serving.client import ServedError, http_generate

    with pytest.raises(ServedError) as e:  # the body as a curl user would send it
        _post(server, body)
    assert re.search(match, str(e.value)), str(e.value)
    assert http_generate(server.http_url, humaneval[0], MAX_NEW_TOKENS=24)["TOKEN_IDS"] == reference["sd", 0]


def _post(server, body):
    from specrt.serving.client import ServedError

    req = urllib.request.Request(f"{server.http_url}/v2/models/specrt/generate", data=json.dumps(body).encode())
    try:
        urllib.request.urlopen(req, timeout=60)
    except urllib.error.HTTPError as e:
        raise ServedError(json.loads(e.read())["error"]) from None


def test_a_wrong_dtype_over_grpc_is_refused(server, humaneval, reference):
    from specrt.serving.client import GrpcStream, ServedError

    with GrpcStream(server.grpc_url) as s:
        with pytest.raises(ServedError, match="MAX_NEW_TOKENS"):
            list(s.generate("x", MAX_NEW_TOKENS=np.array([4.0], dtype=np.float32)))
    with GrpcStream(server.grpc_url) as s:
        assert [t for r in s.generate(humaneval[0], MAX_NEW_TOKENS=24) for t in r.get("TOKEN_IDS", [])] == \
            reference["sd", 0]


def test_a_client_that_goes_away_frees_its_place_and_disturbs_no_one(server, humaneval, reference):
    from specrt.serving.client import GrpcStream, http_generate

    before = quiet(server)
    leaver = GrpcStream(server.grpc_url)
    first = next(leaver.generate(humaneval[1], MAX_NEW_TOKENS=1500, METHOD="autoregressive", STREAM=True))
    assert first["TEXT"] and not first["final"]
    others = []
    t = threading.Thread(target=lambda: others.extend(
        http_generate(server.http_url, humaneval[i], MAX_NEW_TOKENS=24, METHOD="autoregressive")["TOKEN_IDS"]
        == reference["autoregressive", i] for i in range(4)))
    t.start()
    leaver.close(cancel=True)  # gone midway
    t.join(300)
    assert others == [True] * 4
    key = 'specrt_generated_tokens_total{method="autoregressive"}'
    after = settled(server, before, key, 4 * 24 + 1)  # the others' tokens and the cancelled one's
    assert after['specrt_running_sequences{method="autoregressive"}'] == 0, after
    # its place freed at the end of a round, far from its 1500 tokens
    assert 4 * 24 < after[key] - before.get(key, 0) < 4 * 24 + 1500


def test_a_restarted_server_answers_the_same(files, repo, server, humaneval, reference, tmp_path):
    from specrt.serving.client import http_generate

    server.stop()
    again = start_server(files, repo, tmp_path)
    try:
        for i in range(3):
            assert http_generate(again.http_url, humaneval[i], MAX_NEW_TOKENS=24)["TOKEN_IDS"] == reference["sd", i]
    finally:
        assert again.stop() == 0
    assert not _stubs_of(repo)  # no stub process outlives its server


def _stubs_of(repo, binary: bytes = b"triton_python_backend_stub") -> list[int]:
    """Process ids of the Python-backend stubs (or, binary=b"tritonserver", the servers) over `repo`."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith(binary) and str(repo).encode() in b" ".join(cmd):
            out.append(int(proc.name))
    return out


def _gone(repo, timeout: float) -> bool:
    """Whether every server and stub over `repo` has exited within `timeout` seconds (those left are killed)."""
    import os
    import signal
    import time

    deadline = time.monotonic() + timeout
    while left := _stubs_of(repo) + _stubs_of(repo, b"tritonserver"):
        if time.monotonic() > deadline:
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            return False
        time.sleep(0.2)
    return True


def _serve(demo_bundle, repo, *args):
    """`specrt serve` on the demo bundle, once it has printed that Ctrl-C stops it."""
    import subprocess
    import sys

    from specrt.serving.tritonserver import free_ports

    ports = free_ports(3)
    proc = subprocess.Popen([sys.executable, "-m", "specrt", "serve", "--bundle", str(demo_bundle), "--out", str(repo),
                             "--threads", "2", *(f"--{k}-port={v}" for k, v in zip(("http", "grpc", "metrics"), ports)),
                             "--server-dir", str(ROOT / "build" / "tritonserver"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("Ctrl-C"):
            return proc
    proc.kill()
    raise AssertionError(f"specrt serve ended before it was ready: {proc.communicate()[1]}")


def test_a_second_ctrl_c_stops_serve_at_once_and_leaves_nothing_behind(files, demo_bundle, tmp_path):
    """Ctrl-C twice, the second while Triton unloads: the stop is hurried (its process group killed), never cut
    short with the server left running."""
    import signal
    import time

    repo = tmp_path / "repo"
    proc = _serve(demo_bundle, repo, "--openai-port", "0")
    try:
        assert _stubs_of(repo, b"tritonserver") and _stubs_of(repo)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "stopping tritonserver" in err, err
    assert _gone(repo, 10), "a server or stub outlived `specrt serve`"


def test_a_server_whose_starter_dies_exits_too(files, demo_bundle, tmp_path):
    """The process that started a TritonServer killed (SIGKILL: no stop(), no atexit): the server and its stubs exit
    on their own, though the thread that started it had ended long before (the kernel's parent-death signal follows a
    thread: the launcher's lives as long as its process)."""
    import signal
    import subprocess
    import sys

    from specrt.serving.triton import TritonConfig, write_repository

    repo = tmp_path / "repo"
    write_repository(TritonConfig(bundle=demo_bundle, out=repo, method="sd", threads=2))
    script = ("import sys, threading, time; from pathlib import Path; from tests.serving.triton_helpers import "
              "start_server; from specrt.serving.tritonserver import locate; "
              f"t = threading.Thread(target=start_server, args=(locate(Path({str(ROOT / 'build' / 'tritonserver')!r})),"
              f" Path({str(repo)!r}), Path({str(tmp_path)!r}))); t.start(); t.join(); time.sleep(1); "
              "print('ready', flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        assert _stubs_of(repo, b"tritonserver") and _stubs_of(repo)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert _gone(repo, 30), "the server outlived the process that started it"


def test_serve_starts_a_server_that_died_again_and_exits_where_it_cannot(files, demo_bundle, tmp_path):
    """tritonserver killed under `specrt serve` (Triton's Python backend can abort it as a stub dies): started again
    on its ports, and it answers; its log saying that its crash handler caught a signal (after which it may hang,
    alive, for minutes): killed and started again; killed with its repository broken, so that it cannot start: serve
    exits 2 saying so, nothing left running."""
    import os
    import signal
    import threading
    import time

    from specrt.serving.client import http_generate

    repo = tmp_path / "repo"
    proc = _serve(demo_bundle, repo, "--openai-port", "0")
    lines: list[str] = []
    reader = threading.Thread(target=lambda: [lines.append(line) for line in proc.stderr])
    reader.start()
    try:
        url = next(f"http://127.0.0.1:{a.split('=')[1]}" for a in proc.args if a.startswith("--http-port="))
        want = http_generate(url, "def f(x):", MAX_NEW_TOKENS=8)["TOKEN_IDS"]
        gone = []
        for n, death in enumerate(("killed", "crashed"), 1):
            gone += _stubs_of(repo, b"tritonserver")
            if death == "killed":
                os.kill(gone[-1], signal.SIGKILL)
            else:
                with open(tmp_path / "repo-tritonserver.log", "ab") as log:
                    log.write(b"Signal (6) received.\n")
            deadline = time.monotonic() + 60
            while sum("tritonserver restarted in" in line for line in lines) < n:  # seen by specrt serve as well
                assert time.monotonic() < deadline and proc.poll() is None, f"{death}: the server was not started again"
                time.sleep(0.2)
            (again,) = [p for p in _stubs_of(repo, b"tritonserver") if p not in gone]
            assert http_generate(url, "def f(x):", MAX_NEW_TOKENS=8)["TOKEN_IDS"] == want
        (repo / "specrt" / "config.pbtxt").write_text("not a model configuration")
        os.kill(again, signal.SIGKILL)
        proc.wait(120)
    finally:
        proc.kill()
        reader.join()
    err = "".join(lines)
    assert err.count("tritonserver restarted in") == 2 and "tritonserver crashed (status -9" in err, err
    assert proc.returncode == 2 and "specrt: error: tritonserver exited (status -9) and did not start again" in err
    assert _gone(repo, 10)


def test_specrt_serve_runs_until_ctrl_c_and_leaves_nothing_behind(files, demo_bundle, humaneval, reference, tmp_path):
    """The one command: the server found, the repository written, ready, a streamed answer over gRPC and one over the
    OpenAI-compatible route (the `openai` client), Ctrl-C, no stub left."""
    from openai import OpenAI

    import signal
    import subprocess
    import sys

    from specrt.serving.client import GrpcStream, joined
    from specrt.serving.tritonserver import free_ports

    http, grpc, prom, api = free_ports(4)
    repo = tmp_path / "repo"
    proc = subprocess.Popen([sys.executable, "-m", "specrt", "serve", "--bundle", str(demo_bundle), "--out", str(repo),
                             "--threads", "2", "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port",
                             str(prom), "--openai-port", str(api), "--server-dir", str(ROOT / "build" / "tritonserver")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("Ctrl-C"):
                break
        text = "".join(lines)
        assert text.startswith("ready: models specrt; not loaded: specrt_target (no onnxruntime backend here)"), text
        assert f"curl -s -X POST http://127.0.0.1:{http}/v2/models/specrt/generate -d" in text
        assert f"OpenAI   http://127.0.0.1:{api}/v1 (completions, chat/completions, models)" in text
        with GrpcStream(f"127.0.0.1:{grpc}") as s:
            streamed = joined(s.generate(humaneval[2], MAX_NEW_TOKENS=24, STREAM=True))
        assert streamed["TOKEN_IDS"] == reference["sd", 2]
        client = OpenAI(base_url=f"http://127.0.0.1:{api}/v1", api_key="-", max_retries=0)
        (model,) = client.models.list().data
        answer = client.completions.create(model=model.id, prompt=humaneval[2], max_tokens=24, temperature=0)
        assert model.id == demo_bundle.name and answer.choices[0].text == streamed["TEXT"]
        assert _stubs_of(repo)
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "stopped (status 0)" in err and not _stubs_of(repo)


def test_without_server_files_serve_says_what_to_install(demo_bundle, tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "specrt", "serve", "--bundle", str(demo_bundle), "--server-dir",
                        str(tmp_path / "none"), "--no-install"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "no Triton server files in" in r.stderr and "pip install --no-deps --target" in r.stderr
    assert "nvidia-pytriton==0.7.0" in r.stderr


def test_a_default_method_the_bundle_cannot_run_is_refused_as_the_model_loads(files, demo_bundle, tmp_path):
    """`--method auto` on a bundle never tuned: the model's load fails saying what to run, `specrt serve` exits 2 with
    it, and nothing is left running (not a server answering every request with that error)."""
    import subprocess
    import sys

    from specrt.serving.tritonserver import free_ports

    repo = tmp_path / "repo"
    ports = free_ports(3)
    r = subprocess.run([sys.executable, "-m", "specrt", "serve", "--bundle", str(demo_bundle), "--out", str(repo),
                        "--threads", "2", "--method", "auto", "--openai-port", "0",
                        *(f"--{k}-port={v}" for k, v in zip(("http", "grpc", "metrics"), ports)),
                        "--server-dir", str(ROOT / "build" / "tritonserver")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 2, r.stderr
    first = r.stderr.splitlines()[1]  # after the line saying what starts: the error, Triton's reason first
    assert first.startswith("specrt: error: tritonserver exited (status 1) before it was ready: ") and \
        "load failed for model 'specrt'" in first and "BundleError: no plan.json in" in first, r.stderr
    assert "specrt tune --bundle" in first
    assert _gone(repo, 10)
