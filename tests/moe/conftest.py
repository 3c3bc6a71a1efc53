import pytest


@pytest.fixture(scope="session")
def trained_moe():
    """A tiny byte-level MoE (4 layers, 8 experts, top-1) trained briefly on stdlib source, with its history."""
    import torch

    from hpdl.moe.train import TrainOptions, train

    torch.manual_seed(0)
    return train(TrainOptions(steps=60, batch=8, seq=64, hidden=64, checkpoints=3, trace_tokens=1024,
                              max_bytes=400_000), progress=None)
