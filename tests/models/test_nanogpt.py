"""hpdl.models.nanogpt against Hugging Face's GPT2LMHeadModel (random weights, float32, CPU)."""

import pytest
import torch

from hpdl.models.nanogpt import GPT, GPTConfig

transformers = pytest.importorskip("transformers")


def _hf():
    torch.manual_seed(1)
    cfg = transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=24,
                                  attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def test_logits_loss_and_gradients_match_hf_gpt2():
    hf = _hf()
    ours = GPT.from_hf_gpt2(hf).eval()
    idx = torch.randint(0, 97, (3, 24), generator=torch.Generator().manual_seed(0))
    tgt = torch.roll(idx, -1, 1)
    logits, loss = ours(idx, tgt)
    ref = hf(idx, labels=None)
    torch.testing.assert_close(logits, ref.logits, atol=2e-5, rtol=1e-5)
    ref_loss = torch.nn.functional.cross_entropy(ref.logits.reshape(-1, 97), tgt.reshape(-1))
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(ours.h[1].attn.c_attn.weight.grad, hf.transformer.h[1].attn.c_attn.weight.grad.t(),
                               atol=1e-6, rtol=1e-4)
    last, none = ours(idx)
    assert none is None and last.shape == (3, 1, 97)
    torch.testing.assert_close(last[:, 0], ref.logits[:, -1], atol=2e-5, rtol=1e-5)


def test_engineering_facts_and_errors():
    m = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=64))
    n_all = sum(p.numel() for p in m.parameters())
    assert m.num_params() == n_all - 16 * 32 and m.num_params(non_embedding=False) == n_all
    assert m.flops_per_token() == 6 * m.num_params() + 12 * 2 * 16 * 32
    assert m.estimate_mfu(1000.0, m.flops_per_token() * 4000.0) == pytest.approx(0.25)
    opt = m.configure_optimizers(0.1, 1e-3)
    decayed = {id(p) for p in opt.param_groups[0]["params"]}
    assert all((p.dim() >= 2) == (id(p) in decayed) for p in m.parameters())
    with pytest.raises(ValueError, match="block_size=16"):
        m(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="n_head"):
        GPTConfig(n_embd=30, n_head=4)
    hf = _hf()

    class Edited:  # a checkpoint with one tensor cut short, then one missing
        config = hf.config
        sd = dict(hf.state_dict())

        def state_dict(self):
            return self.sd

    bad = Edited()
    bad.sd["transformer.h.0.mlp.c_fc.weight"] = bad.sd["transformer.h.0.mlp.c_fc.weight"][:, :-1]
    with pytest.raises(ValueError, match=r"h\.0\.mlp\.c_fc\.weight"):
        GPT.from_hf_gpt2(bad)
    del bad.sd["transformer.h.1.ln_2.bias"]
    with pytest.raises(ValueError, match="missing.*h.1.ln_2.bias"):
        GPT.from_hf_gpt2(bad)
