"""Reference model architectures (decoder-only GPT-2 and LLaMA with a slot KV cache, for hpdl.serve; a
nanoGPT-style GPT-2 for training, :mod:`hpdl.models.nanogpt`)."""

from hpdl.models.gpt import Batch, DecoderConfig, DecoderLM, KVCache, load_pretrained
from hpdl.models.nanogpt import GPT, GPTConfig

__all__ = ["Batch", "DecoderConfig", "DecoderLM", "GPT", "GPTConfig", "KVCache", "load_pretrained"]
