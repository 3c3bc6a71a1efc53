"""Reference model architectures (decoder-only GPT-2 and LLaMA with a slot KV cache, for hpdl.serve; a
nanoGPT-style GPT-2 for training, :mod:`hpdl.models.nanogpt`; SOFT, :mod:`hpdl.models.soft`).

Importing this package registers the SOFT models with timm's registry (when timm is installed), as timm users
expect of a model package: ``import hpdl.models; timm.create_model("soft_tiny")``.
"""

from hpdl.models.gpt import Batch, DecoderConfig, DecoderLM, KVCache, load_pretrained
from hpdl.models.nanogpt import GPT, GPTConfig
from hpdl.models import soft  # noqa: F401  (registers soft_* with timm)

__all__ = ["Batch", "DecoderConfig", "DecoderLM", "GPT", "GPTConfig", "KVCache", "load_pretrained"]
