"""One bad request never takes the server down (issue 19), through real HTTP and the official openai client.

Each numbered case of the issue is a test here that fails on the code before the fix: request values that
crashed the engine (1), an engine fault that left open requests hanging (2), disconnected non-streaming
requests that kept their slots (3), queue time counted as a timeout (4), finish_reason of a stop string on the
last allowed token (6), and the minor ones (7). Unsupported parameters (5) are in test_api_features.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx
import openai
import pytest

from serve_testutil import hf_greedy, tiny_server
from hpdl.runtime.errors import WorkerFailedError
from hpdl.serve.tokenizer import ByteTokenizer


def _post(url: str, body: dict, path: str = "/v1/completions", timeout: float = 60):
    return httpx.post(url + path, json=body, timeout=timeout)


def _error(r: httpx.Response, status: int, kind: str, param: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["type"] == kind and err["code"] == status and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


def _events(text: str) -> list[dict]:
    lines = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", text[-300:]
    return [json.loads(x) for x in lines[:-1]]


# --- 1. values that crashed the engine for everyone ----------------------------------------------------------
def test_values_that_crashed_the_engine_are_rejected_or_served(server):
    url = server.url
    _error(_post(url, {"prompt": "Hi", "max_tokens": 4, "temperature": 1, "seed": 2**64}), 400,
           "invalid_request_error", "seed")
    _error(_post(url, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 1,
                       "seed": -2**63 - 1}, "/v1/chat/completions"), 400, "invalid_request_error", "seed")
    tiny = _post(url, {"prompt": "Hi", "max_tokens": 4, "temperature": 1e-40, "ignore_eos": True})  # = greedy
    greedy = _post(url, {"prompt": "Hi", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert tiny.status_code == 200 and tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    edge = _post(url, {"prompt": "Hi", "max_tokens": 4, "temperature": 2, "seed": 2**63 - 1, "top_k": 1,
                       "ignore_eos": True})
    assert edge.status_code == 200 and edge.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    assert httpx.get(url + "/health").json() == {"status": "ok"}


# --- one request failing inside a step fails alone ---------------------------------------------------------
_PROMPTS = [[random.Random(i).randrange(1, 200) for _ in range(2 + i % 5)] for i in range(16)]
_MARKER = 5  # the request the injected fault hits
_ORACLE: dict = {}


def _oracle(hf, i: int) -> list[int]:
    if i not in _ORACLE:
        _ORACLE[i] = hf_greedy(hf, _PROMPTS[i], 6 + i % 7)
    return _ORACLE[i]


@pytest.mark.parametrize("where", ["forward", "sampler", "detokenize"])
def test_a_fault_inside_a_step_fails_that_request_alone(server, monkeypatch, where):
    eng, marker = server.engine, _PROMPTS[_MARKER]

    def hit(req):
        return req is not None and req.prompt_ids == marker

    if where == "forward":  # decode forwards holding the marker raise: the engine retries each request alone
        execute = eng.executor.execute

        def faulty(plan):
            if any(hit(r) and len(r.output_ids) >= 2 for r in plan.requests):
                raise RuntimeError("injected forward fault")
            return execute(plan)

        monkeypatch.setattr(eng.executor, "execute", faulty)
    elif where == "sampler":
        sample_row = eng.sampler._sample_row

        def faulty(row, req):
            if hit(req) and len(req.output_ids) >= 3:
                raise ValueError("injected sampler fault")
            return sample_row(row, req)

        monkeypatch.setattr(eng.sampler, "_sample_row", faulty)
    else:
        detok = eng._detokenize

        def faulty(req):
            if hit(req) and len(req.output_ids) >= 3:
                raise UnicodeError("injected detokenizer fault")
            return detok(req)

        monkeypatch.setattr(eng, "_detokenize", faulty)
    stream = where == "detokenize"
    bias = {"logit_bias": {"3": -100.0}} if where == "sampler" else {}  # the marker takes the per-row sampler

    async def go():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*(c.post(server.url + "/v1/completions", json={
                "prompt": p, "max_tokens": 6 + i % 7, "temperature": 0,
                **(bias | {"stream": stream} if i == _MARKER else {})}) for i, p in enumerate(_PROMPTS)))

    rs = asyncio.run(go())
    for i, r in enumerate(rs):
        if i == _MARKER:
            if stream:
                events = _events(r.text)
                assert r.status_code == 200 and events[-1]["error"]["type"] == "server_error", events[-1]
            else:
                assert "injected" in _error(r, 500, "server_error")["message"]
            continue
        ref = _oracle(server.hf, i)
        res = r.json()
        assert r.status_code == 200, res
        assert res["choices"][0]["text"] == ByteTokenizer().decode([t for t in ref if t != 257]), i
        assert res["usage"]["completion_tokens"] == len(ref)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert server.engine.stats()["running"] == 0


# --- 2. an engine fault: every open request gets a 503 at once ---------------------------------------------
def test_engine_fault_answers_every_open_request_at_once(monkeypatch):
    monkeypatch.setenv("HPDL_TIMEOUT", "30")  # the code before the fix waited this long, then sent plain text
    with tiny_server(step_delay=0.01, num_slots=4, max_seq_len=512) as srv:
        execute, steps = srv.engine.executor.execute, [0]

        def dies(plan):
            steps[0] += 1
            if steps[0] > 30:
                raise WorkerFailedError("TP rank 1 is gone (injected)")
            return execute(plan)

        srv.engine.executor.execute = dies

        async def go():
            async with httpx.AsyncClient(timeout=60) as c:
                return await asyncio.gather(*(c.post(srv.url + "/v1/completions", json={
                    "prompt": [i + 1, 2, 3], "max_tokens": 400, "ignore_eos": True, "stream": i % 2 == 0})
                    for i in range(16)))

        t0 = time.perf_counter()
        rs = asyncio.run(go())
        assert time.perf_counter() - t0 < 15
        for i, r in enumerate(rs):
            if i % 2:
                assert "rank 1 is gone" in _error(r, 503, "service_unavailable_error")["message"]
            else:
                assert _events(r.text)[-1]["error"]["type"] == "service_unavailable_error"
        _error(httpx.get(srv.url + "/health"), 503, "service_unavailable_error")
        _error(_post(srv.url, {"prompt": "x", "max_tokens": 2}), 503, "service_unavailable_error")


def test_a_hung_step_marks_the_engine_dead_after_the_step_timeout():
    with tiny_server(num_slots=2, max_seq_len=64, step_timeout=0.5) as srv:
        execute = srv.engine.executor.execute

        def hangs(plan):
            time.sleep(2.5)
            return execute(plan)

        srv.engine.executor.execute = hangs
        t0 = time.perf_counter()
        err = _error(_post(srv.url, {"prompt": "x", "max_tokens": 2}), 503, "service_unavailable_error")
        assert "0.5 s" in err["message"] and time.perf_counter() - t0 < 2.4


# --- 3. disconnects abort streaming and non-streaming requests ---------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_disconnected_clients_free_their_slots(stream):
    with tiny_server(step_delay=0.005, num_slots=4, max_seq_len=1024) as srv:
        body = {"prompt": "x", "max_tokens": 1000, "ignore_eos": True, "stream": stream}

        def gone():  # the client leaves: a read timeout (non-streaming), or closing the stream after 2 events
            if not stream:
                with pytest.raises(httpx.TimeoutException):
                    _post(srv.url, body, timeout=0.5)
                return
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ") and next(lines) == "" and next(lines).startswith("data: ")

        threads = [threading.Thread(target=gone) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        t0 = time.perf_counter()
        while srv.engine.stats()["running"] and time.perf_counter() - t0 < 1.0:
            time.sleep(0.005)
        assert srv.engine.stats()["running"] == 0  # 1000 tokens x 5 ms would hold them for 5 s
        assert srv.finished("abort") == 4 and srv.finished("length") == 0
        r = srv.client.completions.create(model="tiny", prompt="x", max_tokens=8, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 8


# --- 4. queue time is not a timeout ------------------------------------------------------------------------
def test_waiting_in_the_queue_never_times_out(monkeypatch):
    # 3 s, not 1: HPDL_TIMEOUT also bounds one engine step, which a loaded 2-core CI machine can stretch past 1 s
    monkeypatch.setenv("HPDL_TIMEOUT", "3")
    with tiny_server(step_delay=0.02, num_slots=1, max_seq_len=256) as srv:
        first = threading.Thread(target=_post, args=(srv.url, {"prompt": "a", "max_tokens": 200,
                                                               "ignore_eos": True}))
        first.start()  # holds the only slot for about 4 s
        time.sleep(0.2)
        t0 = time.perf_counter()
        r = _post(srv.url, {"prompt": "b", "max_tokens": 4, "ignore_eos": True})
        first.join()
        assert r.status_code == 200, r.text[:300]
        assert r.json()["usage"]["completion_tokens"] == 4 and time.perf_counter() - t0 > 3.0


# --- 6. a stop string completed by the last allowed token ---------------------------------------------------
def test_stop_string_on_the_last_allowed_token_finishes_as_stop(server):
    c = server.client
    for n in range(6, 20):  # an output whose last two characters are complete and occur only there
        full = c.completions.create(model="tiny", prompt="abc", max_tokens=n, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text
        tail = full[-2:]
        if len(full) >= 3 and "\ufffd" not in tail and full.find(tail) == len(full) - 2:
            break
    else:
        pytest.fail("no usable output")
    r = c.completions.create(model="tiny", prompt="abc", max_tokens=n, temperature=0, stop=[tail],
                             extra_body={"ignore_eos": True}).choices[0]
    assert (r.finish_reason, r.text) == ("stop", full[:-2])


# --- 7. the minor ones -----------------------------------------------------------------------------------------
def test_bounds_error_types_token_ids_and_chat_length(server):
    url = server.url
    _error(_post(url, {"prompt": "x", "stop": [f"s{i}" for i in range(20_000)]}), 400, "invalid_request_error",
           "stop")
    _error(_post(url, {"prompt": "x", "model": "gpt-9"}), 404, "not_found_error", "model")
    _error(_post(url, {"prompt": [True, False]}), 400, "invalid_request_error", "prompt")
    _error(httpx.get(url + "/v1/nothing"), 404, "not_found_error")
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "ignore_eos": True}
    res = _post(url, body, "/v1/chat/completions").json()
    assert res["usage"]["completion_tokens"] == 96 - res["usage"]["prompt_tokens"]  # fills the context
    assert res["choices"][0]["finish_reason"] == "length"
    with pytest.raises(openai.BadRequestError, match="max_tokens"):  # the same through the openai client
        server.client.completions.create(model="tiny", prompt="x", max_tokens=500)


@pytest.mark.parametrize("argv, flag", [
    (["--config", "llama-7b"], "--model/--config/--dtype"),
    (["--config", "llama-tiny", "--num-slots", "4096", "--max-seq-len", "1000000"], "--num-slots/--max-seq-len"),
])
def test_a_model_too_big_for_the_host_is_refused_before_allocating(argv, flag, monkeypatch, capsys):
    """Issue 37 item 5: `hpdl serve --config llama-7b` on a small host was silent for 35 s, then failed in an
    allocator without naming a flag. With 16 GiB free it must fail at once, naming the flag, building nothing."""
    import psutil

    import hpdl.serve
    from hpdl.cli import main

    real_vm = psutil.virtual_memory
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real_vm()._replace(available=16 << 30))
    monkeypatch.setattr(hpdl.serve, "LLMEngine", lambda *a, **k: pytest.fail("the engine was built"))
    assert main(["serve", *argv]) == 1
    err = capsys.readouterr().err
    assert f"choose a smaller {flag}" in err and "17.2 GB free" in err   # 16 GiB


def test_memory_estimate_counts_the_weights_it_builds():
    from hpdl.serve.worker import ModelSpec, build_model, memory_estimate

    spec = ModelSpec(config="llama-tiny")
    n = sum(p.numel() for p in build_model(spec, "cpu").parameters())
    est = memory_estimate(spec, num_slots=4, max_seq_len=64)
    assert est["weights"] == 4 * n   # LLaMA: exact (no biases, untied head)
    assert est["kv"] == 2 * 2 * 4 * 64 * 2 * 16 * 4   # layers x (k, v) x slots x positions x kv heads x head_dim
