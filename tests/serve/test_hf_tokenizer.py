"""A model directory with its own tokenizer (trained offline here) and chat template."""

from __future__ import annotations

import pytest
import torch

from serve_testutil import hf_greedy
from hpdl.serve import EngineConfig, LLMEngine, ModelSpec, SamplingParams

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world, a tiny corpus for a tiny tokenizer"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
    torch.manual_seed(5)
    cfg = transformers.LlamaConfig(vocab_size=len(fast), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
                                   bos_token_id=0, eos_token_id=1)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    d = tmp_path_factory.mktemp("tok-model")
    hf.save_pretrained(d)
    fast.save_pretrained(d)
    return str(d), hf, fast


def test_text_prompts_use_the_directory_tokenizer(model_dir):
    d, hf, fast = model_dir
    eng = LLMEngine(ModelSpec(model=d), EngineConfig(num_slots=2, max_seq_len=64))
    chat = eng.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])
    assert chat == "<user>hello\n<assistant>"
    for prompt in ("hello world", chat):
        out = eng.generate([prompt], SamplingParams(max_tokens=12))[0]
        ref = hf_greedy(hf, fast.encode(prompt), 12)
        assert out.token_ids == ref
        assert out.text == fast.decode([t for t in ref if t != 1], skip_special_tokens=True)
