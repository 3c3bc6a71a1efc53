"""Checks that every command runs before it starts work: numeric flags in range, and sizes that fit the machine.

Every CLI of the tour parses its counts with :func:`count` and :func:`real` (argparse types, so a bad value is a
usage error that names the flag, exit 2), and checks the memory a run will ask for with :func:`check_fits` before
allocating it, so a size too big for the host or the GPU fails at once, naming the flag to change, instead of
after minutes in an allocator (issue 37, item 5).
"""

from __future__ import annotations

import argparse
import math
import numbers

# An iteration/step count above this is a typo, not a run: 2**31 steps of the fastest loop we have (~10 us)
# would take 6 hours. Counts are refused above it so that no flag can start a run that never ends.
MAX_COUNT = 1 << 31


class InsufficientMemoryError(MemoryError):
    """A run would ask for more memory than the host or the device has free; the message names the flag."""


def count(minimum: int = 1, maximum: int = MAX_COUNT, name: str = "int"):
    """A checker of an integer in ``[minimum, maximum]``: an argparse ``type`` (it parses the flag's string) and
    the check of an already-typed value (:func:`hpdl.runtime.options.check_options` passes the int a Python caller
    gave; a bool or a float is refused, not truncated). Anything else raises ``argparse.ArgumentTypeError``
    quoting the value (argparse makes it a usage error naming the flag)."""
    def parse(text) -> int:
        if isinstance(text, str):
            try:
                value = int(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        elif isinstance(text, numbers.Integral) and not isinstance(text, bool):
            value = int(text)
        else:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r} ({type(text).__name__})")
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"must be an integer in [{minimum}, {maximum}], got {value}")
        return value

    parse.__name__ = name
    parse.value_type = int   # what a Python caller must pass (check_options refuses a str for it)
    return parse


def real(minimum: float = 0.0, maximum: float = math.inf, strict: bool = False, name: str = "float"):
    """A checker of a finite float in ``[minimum, maximum]`` (``> minimum`` when ``strict``; NaN and inf are
    refused): an argparse ``type`` (it parses the flag's string) and the check of an already-typed int or float
    (a bool is refused); returns a float, else raises ``argparse.ArgumentTypeError`` quoting the value."""
    def parse(text) -> float:
        if isinstance(text, str):
            try:
                value = float(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        elif isinstance(text, numbers.Real) and not isinstance(text, bool):
            value = float(text)
        else:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r} ({type(text).__name__})")
        if not math.isfinite(value) or value < minimum or value > maximum or (strict and value == minimum):
            lo = f"> {minimum:g}" if strict else f">= {minimum:g}"
            hi = f" and <= {maximum:g}" if math.isfinite(maximum) else ""
            raise argparse.ArgumentTypeError(f"must be a finite number {lo}{hi}, got {text}")
        return value

    parse.__name__ = name
    parse.value_type = float   # what a Python caller must pass (an int is taken too; a str is refused)
    return parse


def available_bytes(device: str = "cpu") -> int:
    """Bytes that can be allocated now: ``psutil.virtual_memory().available`` on the host, the free memory of
    ``torch.cuda.mem_get_info`` for a CUDA device (``cuda`` or ``cuda:N``)."""
    if str(device).startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def _fmt(n: float) -> str:
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{int(n)} B"


def check_fits(need_bytes: int, flag: str, *, device: str = "cpu", what: str = "this run",
               fraction: float = 0.9) -> None:
    """Raise :class:`InsufficientMemoryError` naming ``flag`` if ``need_bytes`` exceeds ``fraction`` of what
    :func:`available_bytes` reports for ``device``.

    Args:
        need_bytes: the estimate of what the run allocates (bytes; a lower bound is fine: it only has to catch
            what cannot fit).
        flag: the command-line flag (or argument) that sets the size, e.g. ``"-e/--maxbytes"``.
        device: ``cpu`` (host memory, psutil) or a CUDA device (``torch.cuda.mem_get_info``).
        what: a few words for the message (``"4 ranks x 3 buffers of 32 GB"``).
        fraction: share of the free memory a run may take (the rest is left to the OS and other processes).
    """
    free = available_bytes(device)
    if need_bytes > fraction * free:
        where = "GPU" if str(device).startswith("cuda") else "host"
        raise InsufficientMemoryError(f"{flag}: {what} needs about {_fmt(need_bytes)} but the {where} has "
                                      f"{_fmt(free)} free; choose a smaller {flag}")
