"""Errors the user fixes by changing an input: a file, a folder, a row.

``InputError`` is what the loaders raise for a bad data file, tokenizer folder,
model checkpoint or batch dump. Its message is one line naming the path (and the
line/row or tensor) and what is expected there; the command lines print it and
exit with status 2, without a traceback. A subclass is a ``ValueError``, so code
that caught ``ValueError`` from the loaders keeps working.

``MissingExtraError`` is what an import raises when an optional dependency is not
installed: the base install (``pip install jaxrl``) brings only what ``jaxrl.losses``
needs (jax, numpy), the rest comes with an extra of pyproject.toml (docs/install.md).
Its message is one line naming the extra to install instead of a bare
``ModuleNotFoundError`` for a module the user never chose.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator

# The pyproject.toml extra that brings each optional module jaxrl imports, by top-level name.
_EXTRA_OF = {
    **dict.fromkeys(("flax", "optax", "orbax", "tensorstore", "grain", "transformers", "safetensors", "tokenizers",
                     "math_verify", "tensorboardX", "matplotlib", "pyarrow", "tqdm", "yaml", "requests", "sympy",
                     "mpmath", "langdetect"), "train"),
    "sglang": "sglang", "libtpu": "tpu",
}


class InputError(ValueError):
    """A bad file, folder or row the user must fix; the CLIs print its message in one line and exit 2."""


class InputFileNotFoundError(InputError, FileNotFoundError):
    """A file or folder named by the user does not exist (also a ``FileNotFoundError``)."""


def one_line(error: BaseException | str, limit: int = 300) -> str:
    """An exception's (or text's) message on one line, at most ``limit`` characters, for embedding
    a library's error (transformers, safetensors, zipfile) in an ``InputError`` message."""
    text = error if isinstance(error, str) else (str(error) or type(error).__name__)
    if not isinstance(error, str) and isinstance(error, KeyError) and error.args:
        text = f"missing key {error.args[0]!r}"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class MissingExtraError(ModuleNotFoundError):
    """An optional dependency is missing; the message names the extra that brings it, in one line.

    A ``ModuleNotFoundError`` (``.name`` is the missing module), so code that caught that keeps working.
    """

    def __init__(self, what: str, module: str, extra: str):
        # Not "jaxrl[extra]" by name: jaxrl is installed from its repository (or a wheel built there),
        # and a package of that name on an index is not this one (docs/install.md).
        super().__init__(f'{what} needs the [{extra}] extra ({module} is not installed): '
                         f'pip install ".[{extra}]" in the jaxrl repository (docs/install.md)', name=module)
        self.extra = extra


@contextlib.contextmanager
def needs_extra(what: str) -> Iterator[None]:
    """Imports in this block that fail on a module of an extra raise ``MissingExtraError`` naming
    ``what`` (e.g. ``"jaxrl.models"``) and the extra; other import errors pass unchanged."""
    try:
        yield
    except ModuleNotFoundError as error:
        extra = _EXTRA_OF.get((error.name or "").partition(".")[0])
        if extra is None:
            raise
        # from None: the one-line message is the whole story; the chain would only repeat the module name.
        raise MissingExtraError(what, error.name, extra) from None


def require_modules(what: str, *modules: str) -> None:
    """``MissingExtraError`` for the first of ``modules`` (top-level names) that is not installed.
    Looks them up without importing them, for a package that imports its modules lazily."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            raise MissingExtraError(what, module, _EXTRA_OF[module])
