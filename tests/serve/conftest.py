"""Fixtures for hpdl.serve tests: tiny random-weight HF models saved to a temp dir (the oracle)."""

from __future__ import annotations

import pytest

from serve_testutil import Server, make_hf_model


@pytest.fixture(scope="session", params=["llama", "gpt2"])
def hf_dir(request, tmp_path_factory):
    """(arch, directory, hf model) for each architecture, saved with save_pretrained."""
    model = make_hf_model(request.param)
    d = tmp_path_factory.mktemp(f"hf-{request.param}")
    model.save_pretrained(d)
    return request.param, str(d), model


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """A random-weight HF Llama (seed 7) served over HTTP: 4 slots of 96 positions. ``server.hf`` is the oracle."""
    from hpdl.serve import EngineConfig, LLMEngine, ModelSpec

    hf = make_hf_model("llama", seed=7)
    d = tmp_path_factory.mktemp("srv")
    hf.save_pretrained(d)
    srv = Server(LLMEngine(ModelSpec(model=str(d)), EngineConfig(num_slots=4, max_seq_len=96)))
    srv.hf = hf
    yield srv
    srv.close()
