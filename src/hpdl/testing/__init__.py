"""Test utilities other projects can import too: persistent multi-process rank pools (gloo on CPU)."""

from hpdl.testing.pool import RankPool, get_pool, shutdown_pools

__all__ = ["RankPool", "get_pool", "shutdown_pools"]
