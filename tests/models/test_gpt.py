"""hpdl.models.gpt against Hugging Face transformers (random weights, float32, CPU)."""

from __future__ import annotations

import json

import pytest
import torch

from hpdl.models.gpt import Batch, DecoderConfig, DecoderLM, KVCache, load_pretrained

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)


def _hf(arch):
    torch.manual_seed(1)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    else:
        cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                                       tie_word_embeddings=True)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_prefill_and_decode_logits_match_hf(arch, tmp_path):
    hf = _hf(arch)
    hf.save_pretrained(tmp_path)
    model = load_pretrained(tmp_path)
    cache = KVCache(model.cfg, num_slots=3, max_seq_len=32, dtype=torch.float32, device="cpu")
    a, b = [5, 6, 7, 8, 9], [10, 11, 12]
    toks = torch.tensor([a, b + [0, 0]])
    with torch.no_grad():
        logits = model(toks, cache, Batch(positions=torch.arange(5).expand(2, 5), slots=torch.tensor([2, 0]),
                                          last=torch.tensor([4, 2])))
        torch.testing.assert_close(logits[1], hf(torch.tensor([b])).logits[0, -1], atol=1e-5, rtol=1e-5)
        # decode: slots [0, 3) hold b, (free), a; the free row is ignored
        cache.move(2, 1, 5)  # reorder a into slot 1: decode reads the contiguous range [0, 2)
        step = model(torch.tensor([[13], [14]]), cache, Batch(positions=torch.tensor([[3], [5]]), start=0, kv_len=6))
        torch.testing.assert_close(step[0], hf(torch.tensor([b + [13]])).logits[0, -1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(step[1], hf(torch.tensor([a + [14]])).logits[0, -1], atol=1e-5, rtol=1e-5)


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type"):
        DecoderConfig.from_hf({"model_type": "bert"})


def test_config_validation_and_random_init_is_tp_invariant():
    with pytest.raises(ValueError, match="arch"):
        DecoderConfig(arch="rnn")
    with pytest.raises(ValueError, match="n_kv_heads"):
        DecoderConfig(n_heads=6, n_kv_heads=4)
    cfg = DecoderConfig(arch="llama", vocab_size=50, hidden_size=16, n_layers=1, n_heads=2, n_kv_heads=1,
                        intermediate_size=32, max_position=16)
    a, b = DecoderLM(cfg).init_random(3), DecoderLM(cfg).init_random(3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert a.num_params() == sum(p.numel() for p in a.parameters())
    with pytest.raises(ValueError, match="max_seq_len"):
        KVCache(cfg, 2, 32, torch.float32, "cpu")


@pytest.mark.parametrize("kwargs, message", [
    ({"n_kv_heads": 0}, "n_kv_heads must be an integer >= 1, got 0"), ({"n_heads": 0}, "n_heads must be"),
    ({"hidden_size": -8}, "hidden_size must be"), ({"intermediate_size": 0}, "intermediate_size must be"),
    ({"vocab_size": 0}, "vocab_size must be"), ({"max_position": 0}, "max_position must be"),
    ({"n_layers": 2.0}, "n_layers must be an integer >= 1, got 2.0"), ({"head_dim_": 0}, "head_dim_ must be"),
    ({"eos_token_id": -1}, "eos_token_id must be an integer >= 0"),
    ({"norm_eps": 0.0}, "norm_eps must be a finite number > 0"),
    ({"rope_theta": float("inf")}, "rope_theta must be a finite number > 0")])
def test_decoder_config_fields_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DecoderConfig(**kwargs)
