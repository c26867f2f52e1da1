"""Errors the user fixes by changing an input: a file, a folder, a row.

``InputError`` is what the loaders raise for a bad data file, tokenizer folder,
model checkpoint or batch dump. Its message is one line naming the path (and the
line/row or tensor) and what is expected there; the command lines print it and
exit with status 2, without a traceback. A subclass is a ``ValueError``, so code
that caught ``ValueError`` from the loaders keeps working.
"""

from __future__ import annotations


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
