"""Reference model architectures (decoder-only GPT-2 and LLaMA with a slot KV cache, for hpdl.serve)."""

from hpdl.models.gpt import Batch, DecoderConfig, DecoderLM, KVCache, load_pretrained

__all__ = ["Batch", "DecoderConfig", "DecoderLM", "KVCache", "load_pretrained"]
