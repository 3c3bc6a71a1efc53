"""Issue 38: every sampling parameter at the edges of its range (tiny and huge floats, subnormals, NaN and
infinities, extreme integers, wrong types) gets a 200 or a 400 from the OpenAI server, never a 500, and the
server stays healthy. Each value goes through real HTTP to the shared tiny-Llama server (conftest ``server``)."""

from __future__ import annotations

import json

import httpx

FLOATS = [0.0, -0.0, 5e-324, 1e-300, 1e-40, 1e-5, 0.5, 1.0, 2.0, 100.0, 1e300, 1.7976931348623157e308, -1e-300,
          -2.0, -1e308, float("nan"), float("inf"), float("-inf")]
INTS = [0, 1, -1, 2, 20, 21, 1 << 31, (1 << 31) - 1, 2**63 - 1, 2**63, -2**63, -2**63 - 1, 2**64, 10**30]
FLOAT_FIELDS = ["temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]
INT_FIELDS = ["max_tokens", "top_k", "seed", "min_tokens", "n"]
COMPLETION_INTS = ["logprobs", "best_of"]
CHAT_INTS = ["top_logprobs", "max_completion_tokens"]


def _post(url: str, path: str, body: dict) -> httpx.Response:
    # allow_nan: NaN / Infinity go out as the JS tokens a lenient client would send
    return httpx.post(url + path, content=json.dumps(body, allow_nan=True),
                      headers={"content-type": "application/json"}, timeout=60)


def test_every_sampling_parameter_at_its_edges_is_200_or_400(server):
    url = server.url
    comp = ("/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    chat = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    cases = []
    for f in FLOAT_FIELDS:
        cases += [(r, {f: v}) for v in FLOATS for r in (comp, chat)]
        cases += [(comp, {f: v}) for v in (3, "1", True, None)]  # an int, a string, a bool, null
    for f in INT_FIELDS:
        cases += [(r, {f: v}) for v in INTS for r in (comp, chat)]
        cases += [(comp, {f: v}) for v in (1.0, 1e300, "1", True, None)]
    cases += [(comp, {f: v}) for f in COMPLETION_INTS for v in INTS]
    cases += [(chat, {"logprobs": True, f: v}) for f in CHAT_INTS for v in INTS]
    cases += [(comp, {"logit_bias": {"5": v}}) for v in FLOATS]
    cases += [(comp, {"logit_bias": {str(t): 1.0}}) for t in INTS if t >= 0]
    cases += [(comp, {"stop_token_ids": [t]}) for t in INTS]
    cases += [(comp, {"prompt": [t]}) for t in INTS]  # token-id prompts with out-of-vocabulary and huge ids
    cases += [(comp, {"temperature": 1e-40, "top_p": 5e-324, "top_k": 2**63 - 1, "seed": 2**63 - 1,
                      "repetition_penalty": 100.0, "presence_penalty": 2.0, "frequency_penalty": -2.0})]
    bad = []
    for (path, base), extra in cases:
        r = _post(url, path, base | extra)
        if r.status_code not in (200, 400):
            bad.append((path, extra, r.status_code, r.text[:200]))
        elif r.status_code == 400:
            assert r.json()["error"]["type"] == "invalid_request_error", (extra, r.text[:200])
        else:
            assert r.json()["choices"], (extra, r.text[:200])
    assert not bad, f"{len(bad)} of {len(cases)} requests were neither 200 nor 400: {bad[:10]}"
    assert httpx.get(url + "/health").json() == {"status": "ok"}
