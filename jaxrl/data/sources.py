"""Reading rows from JSONL and Parquet files, each row tagged with its file and index."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Iterator

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Row:
    """One dataset row. ``data`` is None when the row itself could not be read (``error`` says why)."""

    file: str
    index: int
    data: dict[str, Any] | None
    error: str | None = None

    @property
    def where(self) -> str:
        return f"{self.file} row {self.index}"


def read_rows(path: str) -> Iterator[Row]:
    """Yields the rows of a ``.jsonl``/``.json`` (one object per line) or ``.parquet`` file.

    A JSONL line that is not a JSON object is yielded with ``data=None`` and an
    error, so the caller can skip and count it; an unreadable file raises.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path!r} does not exist; check data.train_files/data.eval_files")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        for i, data in enumerate(pq.read_table(path).to_pylist()):
            yield Row(path, i, data)
    elif path.endswith((".jsonl", ".json")):
        with open(path) as f:
            for i, line in enumerate(f):
                if not line.strip():
                    yield Row(path, i, None, "empty line")
                    continue
                try:
                    data = json.loads(line)
                except json.JSONDecodeError as e:
                    yield Row(path, i, None, f"not valid JSON ({e})")
                    continue
                if not isinstance(data, dict):
                    yield Row(path, i, None, f"a JSON {type(data).__name__}, not an object")
                    continue
                yield Row(path, i, data)
    else:
        raise ValueError(f"data file {path!r}: unknown format; use .jsonl (one JSON object per line) or .parquet")
