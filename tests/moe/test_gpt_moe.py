"""hpdl.models.gpt_moe against Hugging Face Mixtral / Qwen2-MoE / OLMoE built from the same config and weights."""
import pytest
import torch

from hpdl.models.gpt import KVCache
from hpdl.models.gpt_moe import MoEConfig, MoEConfigError, MoEDecoder, load_pretrained

transformers = pytest.importorskip("transformers")

CASES = {
    "mixtral": MoEConfig(arch="mixtral", vocab_size=97, hidden_size=32, n_layers=3, n_heads=4, n_kv_heads=2,
                         n_experts=4, top_k=2, expert_size=24, norm_topk_prob=True, bos_token_id=1, eos_token_id=2),
    "qwen2_moe": MoEConfig(arch="qwen2_moe", vocab_size=97, hidden_size=32, n_layers=4, n_heads=4, n_kv_heads=2,
                           n_experts=6, top_k=2, expert_size=16, dense_size=40, moe_every=2, dense_layers=[3],
                           shared_expert_size=20, attention_bias=True),
    "olmoe": MoEConfig(arch="olmoe", vocab_size=97, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=4,
                       n_experts=8, top_k=2, expert_size=16, qk_norm=True),
}


@pytest.mark.parametrize("arch", list(CASES))
def test_logits_and_routing_match_hf(arch, tmp_path):
    cfg = CASES[arch]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg.to_hf()).eval()
    with torch.no_grad():  # HF zero-inits some router weights; random ones make routing matter
        for n, p in hf.named_parameters():
            p.normal_(0, 0.2 if "gate" in n else 0.05)
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    assert ours.cfg.moe_layers == cfg.moe_layers
    ids = torch.randint(0, cfg.vocab_size, (2, 11))
    with torch.no_grad():
        ref = hf(ids, output_router_logits=True)
        logits, router, experts = ours(ids, return_routing=True)
    torch.testing.assert_close(logits, ref.logits, rtol=1e-4, atol=1e-4)
    hf_router = [r for r in ref.router_logits]  # one per MoE layer, [B*T, E]
    assert len(hf_router) == len(router)
    for a, b in zip(router, hf_router):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert experts[0].shape == (22, cfg.top_k)


def test_greedy_matches_hf_generate():
    cfg = CASES["mixtral"]
    torch.manual_seed(1)
    ours = MoEDecoder(cfg).eval()
    hf = transformers.AutoModelForCausalLM.from_config(cfg.to_hf()).eval()
    sd = ours.state_dict()  # our weights into HF through its own (fused-expert, in memory) names
    hsd = hf.state_dict()
    with torch.no_grad():
        hsd["model.embed_tokens.weight"].copy_(sd["embed_tokens.weight"])
        hsd["model.norm.weight"].copy_(sd["norm.weight"])
        hsd["lm_head.weight"].copy_(sd["lm_head.weight"])
        for i in range(cfg.n_layers):
            qkv = sd[f"layers.{i}.attn.qkv_proj.weight"].split([cfg.n_heads * cfg.head_dim,
                                                                 cfg.n_kv_heads * cfg.head_dim,
                                                                 cfg.n_kv_heads * cfg.head_dim])  # fused q|k|v
            for n, w in zip(("q_proj", "k_proj", "v_proj"), qkv):
                hsd[f"model.layers.{i}.self_attn.{n}.weight"].copy_(w)
            hsd[f"model.layers.{i}.self_attn.o_proj.weight"].copy_(sd[f"layers.{i}.attn.o_proj.weight"])
            for n, mine in (("input_layernorm", "ln_1"), ("post_attention_layernorm", "ln_2")):
                hsd[f"model.layers.{i}.{n}.weight"].copy_(sd[f"layers.{i}.{mine}.weight"])
            mlp = [k for k in hsd if k.startswith(f"model.layers.{i}.mlp.") or
                   k.startswith(f"model.layers.{i}.block_sparse_moe.")]
            gate = next(k for k in mlp if k.endswith("gate.weight"))
            hsd[gate].copy_(sd[f"layers.{i}.mlp.gate.weight"])
            gu = next(k for k in mlp if k.endswith("gate_up_proj"))
            dn = next(k for k in mlp if k.endswith("down_proj"))
            hsd[gu].copy_(sd[f"layers.{i}.mlp.w_gate_up"])
            hsd[dn].copy_(sd[f"layers.{i}.mlp.w_down"])
    prompt = [5, 9, 13, 2 + 1, 40]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    assert ours.greedy(prompt, 8) == ref


def test_cache_attention_equals_full_forward_and_padding():
    cfg = CASES["qwen2_moe"]
    torch.manual_seed(2)
    m = MoEDecoder(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 9))
    with torch.no_grad():
        full = m(ids)
        # packed path: the engine's per-token attention over a cache
        cache = KVCache(cfg, 1, 16)
        h = m.embed(ids[0])
        req, pos = torch.zeros(9, dtype=torch.long), torch.arange(9)
        for blk in m.layers:
            h = h + blk.attn.cached(blk.ln_1(h), m.rope(pos), cache, req, pos)[0]
            h = h + blk.mlp(blk.ln_2(h))
        torch.testing.assert_close(m.head(h), full[0], rtol=1e-5, atol=1e-5)
        # right padding does not change the real rows
        padded = torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], 1)
        am = torch.cat([torch.ones(1, 9), torch.zeros(1, 4)], 1)
        torch.testing.assert_close(m(padded, am)[0, :9], full[0], rtol=1e-5, atol=1e-5)


def test_config_errors_name_the_field():
    with pytest.raises(MoEConfigError, match="top_k"):
        MoEConfig(n_experts=4, top_k=5)
    with pytest.raises(MoEConfigError, match="model_type"):
        MoEConfig.from_hf({"model_type": "gpt2"})
    with pytest.raises(MoEConfigError, match="no MoE layer"):
        MoEConfig(n_layers=2, moe_every=3)
    with pytest.raises(MoEConfigError, match="multiple of n_heads"):
        MoEConfig(hidden_size=30, n_heads=4)
    with pytest.raises(MoEConfigError, match="head_dim=3 must be even"):
        MoEConfig(hidden_size=12, n_heads=4, n_kv_heads=4)


@pytest.mark.parametrize("kwargs, message", [
    ({"n_kv_heads": 0}, r"n_kv_heads must be an integer >= 1, got 0"),        # was a ZeroDivisionError
    ({"n_heads": 0}, r"n_heads must be an integer >= 1, got 0"),              # likewise
    ({"expert_size": -4}, r"expert_size must be an integer >= 1, got -4"),    # these three: raw torch errors
    ({"hidden_size": -64}, r"hidden_size must be an integer >= 1, got -64"),
    ({"shared_expert_size": -3}, r"shared_expert_size must be an integer >= 0, got -3"),
    ({"expert_size": 0}, r"expert_size must be an integer >= 1, got 0"),      # these: accepted before
    ({"vocab_size": 0}, r"vocab_size must be an integer >= 1, got 0"),
    ({"max_position": 0}, r"max_position must be an integer >= 1, got 0"),
    ({"norm_eps": -1}, r"norm_eps must be a finite number > 0, got -1"),
    ({"top_k": 1.5}, r"top_k must be an integer >= 1, got 1.5"),
    ({"n_experts": True}, r"n_experts must be an integer >= 1, got True"),
    ({"dense_layers": [99]}, r"dense_layers must hold layer indices in \[0, n_layers=4\), got \[99\]"),
    ({"dense_layers": [-1]}, r"dense_layers must hold layer indices"),
])
def test_config_fields_are_checked(kwargs, message):
    with pytest.raises(MoEConfigError, match=message):
        MoEConfig(**kwargs)


def test_malformed_checkpoint_dirs_name_the_file_or_key(tmp_path):
    import json

    from hpdl.models.gpt_moe import load_model

    (tmp_path / "config.json").write_text("{bad json")
    with pytest.raises(MoEConfigError, match="config.json: not valid JSON"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    with pytest.raises(MoEConfigError, match="config.json: missing key 'vocab_size'"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "mixtral", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
         "num_attention_heads": 2, "num_experts_per_tok": 1, "num_local_experts": 2, "intermediate_size": 4}))
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(MoEConfigError, match="model.safetensors: not a readable safetensors"):
        load_model(tmp_path)
    (tmp_path / "hpdl_moe.pt").write_bytes(b"not a torch file")
    with pytest.raises(MoEConfigError, match="hpdl_moe.pt: not a loadable"):
        load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_model(tmp_path / "absent")


def test_sharded_checkpoint_follows_the_index(tmp_path):
    """save_pretrained with a small shard size writes an index; a stale shard beside it must not be merged."""
    import json

    from safetensors.torch import save_file

    cfg = CASES["mixtral"]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg.to_hf()).eval()
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ref = load_pretrained(tmp_path)
    # an old single-file export left in the directory, with different values for the same names
    save_file({"model.embed_tokens.weight": torch.zeros(cfg.vocab_size, cfg.hidden_size)},
              str(tmp_path / "zz-stale.safetensors"))
    got = load_pretrained(tmp_path)
    assert torch.equal(got.embed_tokens.weight, ref.embed_tokens.weight)
    assert got.embed_tokens.weight.abs().sum() > 0
    missing = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / missing).unlink()
    with pytest.raises(FileNotFoundError, match=missing):
        load_pretrained(tmp_path)


def test_old_layout_checkpoint_loads_with_its_logits(tmp_path):
    """data/moe_v1/hpdl_moe.pt was written by save_checkpoint at 765c418, before the MoE decoder became gpt's
    Block (its own q/k/v/o projections, input_layernorm, SwiGLU gate/up/down, config key dense_size), with that
    code's logits and router logits in ``extra``. Every feature is on: a dense layer, a shared expert, qkv bias,
    qk-norm, GQA."""
    from pathlib import Path

    from hpdl.models.gpt_moe import load_model, save_checkpoint, upgrade_state_dict

    path = Path(__file__).parent / "data" / "moe_v1"
    blob = torch.load(path / "hpdl_moe.pt", weights_only=True)
    assert "layers.0.q_proj.weight" in blob["state_dict"] and "dense_size" in blob["config"]
    m = load_model(path)
    assert m.cfg.intermediate_size == blob["config"]["dense_size"] == 12
    # the config hash in traces and placements fitted before the change still matches
    assert m.cfg.identity() == "6c7ba8f770b38169" and MoEConfig().identity() == "6c0ff8f34d155081"
    ex = blob["extra"]
    with torch.no_grad():
        logits, router, _ = m(ex["ids"], return_routing=True)
    torch.testing.assert_close(logits, ex["logits"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(router[0], ex["router_logits"], rtol=1e-5, atol=1e-5)
    # current-layout dicts pass through; a re-saved checkpoint loads the same model
    sd = m.state_dict()
    assert upgrade_state_dict(m.cfg, sd) is sd
    save_checkpoint(m, tmp_path)
    assert "dense_size" not in torch.load(tmp_path / "hpdl_moe.pt", weights_only=True)["config"]
    with torch.no_grad():
        torch.testing.assert_close(load_model(tmp_path)(ex["ids"]), logits, rtol=0, atol=0)
    with pytest.raises(MoEConfigError, match="layers.1.q_proj.weight"):
        upgrade_state_dict(m.cfg, {k: v for k, v in blob["state_dict"].items() if k != "layers.1.q_proj.weight"})


def test_old_layout_checkpoint_runs_past_its_max_position(tmp_path):
    """The first layout computed RoPE at any position, so its max_position=32 was never a limit: a 40-token
    forward ran before the upgrade and must still run (it raised "ids has 33 positions" after it), with the
    logits of the same weights under a config whose tables reach 64, and the config identity unchanged. A
    re-saved copy keeps that; a model of the current layout still refuses positions past its max_position."""
    import dataclasses
    from pathlib import Path

    from hpdl.models.gpt_moe import load_model, save_checkpoint

    m = load_model(Path(__file__).parent / "data" / "moe_v1")
    assert m.cfg.max_position == 32 and m.rope_grows and m.position_limit is None
    ids = torch.randint(0, m.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    wide = MoEDecoder(dataclasses.replace(m.cfg, max_position=64)).eval()
    wide.load_state_dict(m.state_dict())
    with torch.no_grad():
        got = m(ids)
        torch.testing.assert_close(got, wide(ids), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(m(ids[:, :32]), got[:, :32], rtol=1e-5, atol=1e-5)   # causal: a prefix
    assert m.cfg.identity() == "6c7ba8f770b38169" and m.cfg.max_position == 32
    save_checkpoint(m, tmp_path / "again")
    again = load_model(tmp_path / "again")
    assert again.rope_grows
    with torch.no_grad():
        torch.testing.assert_close(again(ids), got, rtol=0, atol=0)
    save_checkpoint(wide, tmp_path / "new")
    new = load_model(tmp_path / "new")
    assert not new.rope_grows and new.position_limit == 64
    with pytest.raises(MoEConfigError, match="ids has 65 positions, more than max_position=64"):
        new(torch.zeros(1, 65, dtype=torch.long))
