"""hpdl: fast collectives, scheduling and serving for deep learning and HPC jobs on GPU clusters."""

__version__ = "0.1.0"
