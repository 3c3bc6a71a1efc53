"""Test helpers for hpdl.serve (a uniquely named module, so it never clashes with other folders' conftest)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

transformers = pytest.importorskip("transformers")


def make_hf_model(arch: str, seed: int = 0):
    """A tiny HF GPT2 or Llama with random weights (vocab 258: bytes + <bos> 256 + <eos> 257), float32."""
    torch.manual_seed(seed)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=258, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                      bos_token_id=256, eos_token_id=257)
    else:
        cfg = transformers.LlamaConfig(vocab_size=258, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
                                       bos_token_id=256, eos_token_id=257)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face generate for this request alone (greedy; stops at EOS like the engine)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=model.config.eos_token_id)
    return out[0, len(prompt):].tolist()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn serving the app in a background thread on a free port; ``url`` is its base URL."""

    def __init__(self, app):
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline:
                raise TimeoutError("uvicorn did not start in 30 s")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of a direct HF forward over ``ids``: row t is the distribution after token t, [len, vocab]."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


class Server:
    """An engine behind a live HTTP server: ``url``, ``engine`` (LLMEngine), ``client`` (openai, no retries)."""

    def __init__(self, engine, name: str = "tiny", step_timeout: float | None = None):
        import openai

        from hpdl.serve.api_server import build_app
        from hpdl.serve.async_engine import AsyncEngine
        from hpdl.serve.metrics import ServeMetrics

        self.engine, self.name = engine, name
        self.metrics = ServeMetrics()
        kw = {"step_timeout": step_timeout} if step_timeout is not None else {}
        self.async_engine = AsyncEngine(engine, self.metrics, **kw)
        self.live = LiveServer(build_app(self.async_engine, name, self.metrics))
        self.url = self.live.url
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def finished(self, reason: str) -> float:
        """``hpdl_request_success_total{finish_reason=reason}`` from /metrics."""
        import httpx

        key = f'hpdl_request_success_total{{finish_reason="{reason}"}}'
        lines = [ln for ln in httpx.get(self.url + "/metrics").text.splitlines() if ln.startswith(key)]
        return float(lines[0].split()[-1]) if lines else 0.0

    def close(self):
        self.live.stop()
        self.async_engine.shutdown()


@contextlib.contextmanager
def tiny_server(step_delay: float = 0.0, step_timeout: float | None = None, **engine_config):
    """llama-tiny (random weights, byte tokenizer) served live; ``step_delay`` seconds are added to every forward
    (a slow device, so that requests are still running when a test acts on them)."""
    from hpdl.serve import EngineConfig, LLMEngine, ModelSpec

    engine = LLMEngine(ModelSpec(config="llama-tiny"), EngineConfig(**engine_config))
    if step_delay:
        execute = engine.executor.execute

        def slow(plan):
            time.sleep(step_delay)
            return execute(plan)

        engine.executor.execute = slow
    srv = Server(engine, step_timeout=step_timeout)
    try:
        yield srv
    finally:
        srv.close()


def run_interpreted(path: str, timeout: float = 170) -> None:
    """Run test file ``path`` as a script under ``TRITON_INTERPRET=1`` (the interpreter must be chosen before
    Triton is imported, so in a fresh process) and check that it printed ``ok``."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ok" in r.stdout
