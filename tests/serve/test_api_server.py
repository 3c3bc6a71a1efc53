"""The OpenAI-compatible server through real HTTP (uvicorn + httpx), including concurrent clients."""

from __future__ import annotations

import asyncio
import json

import httpx

from serve_testutil import hf_greedy
from hpdl.serve.tokenizer import ByteTokenizer


def _sse(text: str) -> list:
    lines = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_completion_stream_equals_non_stream(server):
    url = server.url
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    res = r.json()
    assert res["object"] == "text_completion" and res["choices"][0]["finish_reason"] == "length"
    assert res["usage"] == {"prompt_tokens": 19, "completion_tokens": 40, "total_tokens": 59}
    s = httpx.post(f"{url}/v1/completions", json=body | {"stream": True, "stream_options": {"include_usage": True}},
                   timeout=60)
    chunks = _sse(s.text)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == res["choices"][0]["text"]
    assert chunks[-1]["usage"] == res["usage"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_stop_string_streaming_matches(server):
    url = server.url
    body = {"prompt": "abc", "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    full = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    stop = full[5:7]
    res = httpx.post(f"{url}/v1/completions", json=body | {"stop": stop}, timeout=60).json()
    assert res["choices"][0]["finish_reason"] == "stop" and res["choices"][0]["text"] == full[: full.find(stop)]
    chunks = _sse(httpx.post(f"{url}/v1/completions", json=body | {"stop": stop, "stream": True}, timeout=60).text)
    assert "".join(c["choices"][0]["text"] for c in chunks) == res["choices"][0]["text"]


def test_chat_completion_and_stream(server):
    url = server.url
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    res = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    assert res["object"] == "chat.completion" and res["choices"][0]["message"]["role"] == "assistant"
    chunks = _sse(httpx.post(f"{url}/v1/chat/completions", json=body | {"stream": True}, timeout=60).text)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == res["choices"][0]["message"]["content"]


def test_concurrent_clients_get_their_solo_tokens(server):
    url, hf = server.url, server.hf
    prompts = [[(7 * i + j) % 256 for j in range(3 + i)] for i in range(8)]  # 8 clients, 4 slots

    async def go():
        async with httpx.AsyncClient(timeout=120) as c:
            rs = await asyncio.gather(*(c.post(f"{url}/v1/completions", json={
                "prompt": p, "max_tokens": 10 + i, "temperature": 0}) for i, p in enumerate(prompts)))
            return [r.json() for r in rs]

    results = asyncio.run(go())
    for i, (p, res) in enumerate(zip(prompts, results)):
        ref = hf_greedy(hf, p, 10 + i)
        assert res["usage"]["completion_tokens"] == len(ref)
        assert res["choices"][0]["finish_reason"] == ("stop" if ref[-1] == 257 else "length")
        assert res["choices"][0]["text"] == ByteTokenizer().decode([t for t in ref if t != 257])


def test_errors_are_4xx_json_and_server_keeps_serving(server):
    url = server.url
    cases = [({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"), ({"prompt": "x", "max_tokens": 500}, 400, None),
             ({"prompt": "x", "temperature": -1}, 400, "temperature"), ({"max_tokens": 3}, 400, "prompt"),
             ({"prompt": [1, 100000]}, 400, None), ({"prompt": "x", "model": "gpt-9"}, 404, "model")]
    for body, code, param in cases:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == code, body
        err = r.json()["error"]
        assert err["code"] == code and err["message"] and (param is None or err["param"] == param)
    r = httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 3, "ignore_eos": True}, timeout=30)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_models_health_metrics(server):
    url = server.url
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny"
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 4, "ignore_eos": True}, timeout=30)
    text = httpx.get(f"{url}/metrics").text
    for name in ("hpdl_num_requests_waiting", "hpdl_num_requests_running", "hpdl_kv_slots_used",
                 "hpdl_time_to_first_token_seconds_bucket", "hpdl_time_per_output_token_seconds_count"):
        assert name in text
    count = [ln for ln in text.splitlines() if ln.startswith("hpdl_e2e_request_latency_seconds_count")]
    assert float(count[0].split()[-1]) >= 1


def test_benchmark_client_over_http(server):
    from hpdl.serve.bench import make_workload, run_http, summarize

    url = server.url
    wl = make_workload(6, (3, 8), (2, 6), request_rate=50.0, vocab_size=256, seed=2)
    recs = asyncio.run(run_http(url, "tiny", wl, max_concurrency=3))
    assert all(r.finish is not None and r.token_times and r.ttft >= 0 for r in recs)
    s = summarize(recs, slo_ttft_ms=10_000)
    assert s["requests"] == 6 and s["goodput"] > 0 and s["p99_e2el_ms"] >= s["median_e2el_ms"]


def test_usage_counts_each_prompt_once_whatever_n(server):
    """OpenAI and vLLM count a prompt's tokens once per prompt, not once per choice (``n``, ``best_of``)."""
    url = server.url
    base = {"max_tokens": 3, "min_tokens": 3, "ignore_eos": True, "seed": 1}
    one = httpx.post(f"{url}/v1/completions", json=base | {"prompt": "abcd"}, timeout=60).json()["usage"]
    assert one == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    for extra, done in (({"n": 3}, 9), ({"n": 2, "best_of": 3}, 9)):
        u = httpx.post(f"{url}/v1/completions", json=base | {"prompt": "abcd"} | extra, timeout=60).json()["usage"]
        assert u == {"prompt_tokens": 4, "completion_tokens": done, "total_tokens": 4 + done}, extra
    u = httpx.post(f"{url}/v1/completions", json=base | {"prompt": ["abcd", "abcd", "xy"], "n": 2},
                   timeout=60).json()["usage"]
    assert u["prompt_tokens"] == 10 and u["completion_tokens"] == 18  # a repeated prompt is a prompt of its own
    s = httpx.post(f"{url}/v1/completions", json=base | {"prompt": "abcd", "n": 2, "stream": True,
                                                        "stream_options": {"include_usage": True}}, timeout=60)
    assert _sse(s.text)[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}
    chat = base | {"messages": [{"role": "user", "content": "hi"}]}
    solo = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60).json()["usage"]["prompt_tokens"]
    u = httpx.post(f"{url}/v1/chat/completions", json=chat | {"n": 3}, timeout=60).json()["usage"]
    assert u["prompt_tokens"] == solo and u["completion_tokens"] == 9
    s = httpx.post(f"{url}/v1/chat/completions", json=chat | {"n": 2, "stream": True,
                                                              "stream_options": {"include_usage": True}}, timeout=60)
    assert _sse(s.text)[-1]["usage"]["prompt_tokens"] == solo
