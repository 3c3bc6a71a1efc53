"""How bytes move: point-to-point over torch.distributed, shared buffers, GPU kernels."""
