"""Reading rows from JSONL and Parquet files, each row tagged with its file and 1-based line/row number."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Iterator

from jaxrl.errors import InputError, InputFileNotFoundError, one_line

log = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)


@dataclasses.dataclass(frozen=True)
class Row:
    """One dataset row. ``data`` is None when the row itself could not be read.

    index: 1-based: the line number in a JSONL file (as an editor or ``sed -n Np``
      counts, blank lines included), the row number in a Parquet file.
    unit: "line" (JSONL) or "row" (Parquet); ``where`` reads "FILE line N" / "FILE row N".
    error: for an unreadable row, the problem ("not valid UTF-8", "not valid JSON", ...),
      the same text for every row with that problem; ``detail`` says where or why in
      this row ("at byte 7 of the line (0xff, file offset 1234)"); ``problem`` joins them
      ("not valid UTF-8: at byte 7 ...").
    """

    file: str
    index: int
    data: dict[str, Any] | None
    error: str | None = None
    detail: str | None = None
    unit: str = "line"

    @property
    def where(self) -> str:
        return f"{self.file} {self.unit} {self.index}"

    @property
    def problem(self) -> str | None:
        if self.error is None:
            return None
        return f"{self.error}: {self.detail}" if self.detail else self.error


def _check_file(path: str) -> None:
    if not os.path.exists(path):
        raise InputFileNotFoundError(
            f"data file {path!r} does not exist; check data.train_files/data.eval_files")
    if os.path.isdir(path):
        raise InputError(f"data file {path!r} is a folder; list the .jsonl/.parquet files in it instead")
    if not path.endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES):
        raise InputError(
            f"data file {path!r}: unknown format; use .jsonl (one JSON object per line) or .parquet")


def _jsonl_rows(path: str) -> Iterator[Row]:
    offset = 0  # of the current line in the file, for the UTF-8 error message
    try:
        f = open(path, "rb")
    except OSError as e:
        raise InputError(f"data file {path!r} cannot be read: {one_line(e.strerror or e)}") from e
    with f:
        for number, raw in enumerate(f, 1):
            line_start, offset = offset, offset + len(raw)
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark: not part of the row
                raw = raw[3:]
                line_start += 3
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Row(path, number, None, "not valid UTF-8",
                          f"at byte {e.start} of the line (0x{raw[e.start]:02x}, file offset {line_start + e.start})")
                continue
            if not line.strip():
                yield Row(path, number, None, "empty line")
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as e:
                yield Row(path, number, None, "not valid JSON", str(e))
                continue
            except RecursionError:
                yield Row(path, number, None, "not valid JSON", "nested too deeply")
                continue
            if not isinstance(data, dict):
                yield Row(path, number, None, "not a JSON object", f"a JSON {type(data).__name__}")
                continue
            yield Row(path, number, data)


def _parquet_rows(path: str) -> Iterator[Row]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    fix = "the file is truncated or not Parquet; re-write it (e.g. pyarrow.parquet.write_table)"
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"data file {path!r} is not a readable Parquet file ({one_line(e)}); {fix}") from e
    number = 0
    try:
        for batch in parquet.iter_batches():
            for data in batch.to_pylist():
                number += 1
                yield Row(path, number, data, unit="row")
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"data file {path!r} cannot be read past row {number} ({one_line(e)}); {fix}") from e


def read_rows(path: str) -> Iterator[Row]:
    """Yields the rows of a ``.jsonl``/``.json`` (one object per line) or ``.parquet`` file.

    A JSONL line that cannot be read (bytes that are not UTF-8, not JSON, not a JSON
    object, blank) is yielded with ``data=None`` and ``error``, so the caller can skip
    and count it; the other lines are read as usual. A missing file, an unknown suffix,
    or a Parquet file that cannot be read raise ``InputError`` naming the file; the
    suffix and existence are checked on the first ``next()``.
    """
    _check_file(path)
    if path.endswith(PARQUET_SUFFIXES):
        yield from _parquet_rows(path)
    else:
        yield from _jsonl_rows(path)
