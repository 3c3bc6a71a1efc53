import doctest
import importlib

import pytest

MODULES = ["channel", "load", "ti", "impedance", "protocol", "simulate"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    mod = importlib.import_module(f"hpdl.tes.{name}")
    result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
