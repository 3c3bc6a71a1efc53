"""nanoGPT-style data-parallel training of a byte-level GPT on the Python standard library's source.

    torchrun --nproc-per-node 4 examples/train_gpt.py --comm hpdl --device cpu   # hpdl.comm gradient buckets
    torchrun --nproc-per-node 4 examples/train_gpt.py --comm nccl --device cpu   # plain DDP (gloo on CPU)
    torchrun --nproc-per-node 4 examples/train_gpt.py --comm hpdl-ddp            # DDP + hpdl's comm hook
    torchrun --nproc-per-node 2 examples/train_gpt.py --device cuda --comm hpdl --dtype bfloat16 \
        --n-layer 12 --n-embd 768 --n-head 12 --block-size 1024 --batch-size 8
    python examples/train_gpt.py --steps 20                                      # one process

Every option: `python examples/train_gpt.py --help`; design and numbers: docs/apps.md.
"""

import sys

from hpdl.apps.cli import main_train

if __name__ == "__main__":
    sys.exit(main_train())
