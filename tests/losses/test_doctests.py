"""The losses' docstring examples run as tests: every public loss shows how it is called, and the
numbers it shows are the ones it returns (each worked out by hand from its equation)."""

import doctest
import importlib
import pkgutil

import pytest

import jaxrl.losses

MODULES = sorted(m.name for m in pkgutil.iter_modules(jaxrl.losses.__path__, "jaxrl.losses.")
                 if not m.name.rpartition(".")[2].startswith("_"))


@pytest.mark.parametrize("name", MODULES)
def test_the_docstring_examples_hold(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed (printed above)"


def test_every_public_loss_has_an_example():
    missing = []
    for name in jaxrl.losses.__all__:
        value = getattr(jaxrl.losses, name)
        if name.startswith("_") or not callable(value) or not getattr(value, "__module__", "").startswith(
                "jaxrl.losses"):
            continue
        if ">>>" not in (value.__doc__ or ""):
            missing.append(name)
    assert not missing, f"public losses without a doctest example: {missing}"
