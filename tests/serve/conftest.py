"""Fixtures for hpdl.serve tests: tiny random-weight HF models saved to a temp dir (the oracle)."""

from __future__ import annotations

import pytest

from serve_testutil import make_hf_model


@pytest.fixture(scope="session", params=["llama", "gpt2"])
def hf_dir(request, tmp_path_factory):
    """(arch, directory, hf model) for each architecture, saved with save_pretrained."""
    model = make_hf_model(request.param)
    d = tmp_path_factory.mktemp(f"hf-{request.param}")
    model.save_pretrained(d)
    return request.param, str(d), model
