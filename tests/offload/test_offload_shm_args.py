"""hpdl.offload.shm.empty's argument and directory errors (a hostile review): each names what was wrong."""

import pytest
import torch

import hpdl.offload.shm as hs
from hpdl.offload.errors import OffloadError


def test_a_missing_directory_names_the_variable_and_the_folder(tmp_path, monkeypatch):
    missing = tmp_path / "missing"
    monkeypatch.setenv("HPDL_OFFLOAD_SHM_DIR", str(missing))   # was a raw FileNotFoundError on a temporary name
    with pytest.raises(OffloadError, match=f"HPDL_OFFLOAD_SHM_DIR={missing} is not a directory"):
        hs.empty((4,))
    assert not missing.exists()


@pytest.mark.parametrize("shape, exc", [((-4,), ValueError), ((2, -1), ValueError), ((2.5,), TypeError),
                                        (2.5, TypeError), ("ab", TypeError), ((True, 2), TypeError)])
def test_a_bad_shape_is_named(shape, exc, tmp_path, monkeypatch):
    monkeypatch.setenv("HPDL_OFFLOAD_SHM_DIR", str(tmp_path))
    # (-4,) said "nbytes must be >= 0, got -16"; (2.5,) was torch's TypeError
    with pytest.raises(exc, match=r"shape must be an int or a sequence of ints >= 0, got " + repr(shape)
                       .replace("(", r"\(").replace(")", r"\)")):
        hs.empty(shape, torch.float32)


def test_good_shapes_still_allocate(tmp_path, monkeypatch):
    monkeypatch.setenv("HPDL_OFFLOAD_SHM_DIR", str(tmp_path))
    for shape, want in ((3, (3,)), ([2, 3], (2, 3)), (torch.Size([4]), (4,)), ((), ()), ((0, 5), (0, 5))):
        t = hs.empty(shape, torch.int32)
        assert tuple(t.shape) == want and t.dtype == torch.int32 and not t.any()
