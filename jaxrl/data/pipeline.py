"""Prompt and SFT datasets as Grain pipelines: validate, tokenise, shard, shuffle, batch, resume.

Rows are read and tokenised once at start-up (so every process agrees on which
rows are valid and the bad-row count is known before training); Grain then
shards row indices by process, shuffles them with a seed (a new permutation
each epoch), repeats and batches them. The iterator's state is a small dict
(``state()``/``restore()``) saved in every checkpoint, so a resumed run sees
exactly the batches the uninterrupted run would have seen.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

import grain
import numpy as np

from jaxrl.data.sources import Row, read_rows
from jaxrl.data.tokenizer import encode_prompt

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the prompts come from and how they are tokenised.

    train_files/eval_files: .jsonl or .parquet files. prompt_field / response_field:
    row fields holding the prompt and (SFT only) the target response. tokenizer: a
    local folder. max_prompt_tokens: longer prompts are bad rows (skipped, counted).
    max_response_tokens: SFT responses longer than this are bad rows.
    """

    tokenizer: str = ""
    train_files: tuple[str, ...] = ()
    eval_files: tuple[str, ...] = ()
    prompt_field: str = "prompt"
    response_field: str = "response"
    use_chat_template: bool = True
    system_prompt: str | None = None
    max_prompt_tokens: int = 512
    max_response_tokens: int = 512
    shuffle: bool = True
    seed: int = 0

    def __post_init__(self):
        if self.max_prompt_tokens < 1 or self.max_response_tokens < 1:
            raise ValueError(
                f"max_prompt_tokens ({self.max_prompt_tokens}) and max_response_tokens "
                f"({self.max_response_tokens}) must be >= 1"
            )


@dataclasses.dataclass(frozen=True)
class Example:
    """A valid row: its prompt (text and ids), the SFT response ids (empty for RL), and the raw row."""

    prompt: str
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    row: dict[str, Any]
    where: str


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """How many rows were read, kept and skipped (by reason)."""

    total_rows: int
    bad_rows: int
    bad_by_reason: dict[str, int]


class AllRowsBadError(ValueError):
    """Every row of a dataset was invalid."""


def _row_problem(row: Row, config: DataConfig, tokenizer, with_response: bool) -> tuple[str, str] | Example:
    """An Example for a good row, else (reason, message) naming the row."""
    if row.data is None:
        return "unreadable", row.error or "unreadable"
    prompt = row.data.get(config.prompt_field)
    if prompt is None:
        return "missing_field", f"missing field {config.prompt_field!r} (fields: {sorted(row.data)})"
    if not isinstance(prompt, str) or not prompt.strip():
        return "empty_prompt", f"empty or non-text prompt {prompt!r}"
    prompt_ids = encode_prompt(
        tokenizer, prompt, use_chat_template=config.use_chat_template, system_prompt=config.system_prompt
    )
    if len(prompt_ids) > config.max_prompt_tokens:
        return "too_long", f"prompt has {len(prompt_ids)} tokens > data.max_prompt_tokens={config.max_prompt_tokens}"
    response_ids: list[int] = []
    if with_response:
        response = row.data.get(config.response_field)
        if response is None:
            return "missing_field", f"missing field {config.response_field!r} (fields: {sorted(row.data)})"
        if not isinstance(response, str) or not response:
            return "empty_response", f"empty or non-text response {response!r}"
        response_ids = list(tokenizer.encode(response, add_special_tokens=False)) + [tokenizer.eos_token_id]
        if len(response_ids) > config.max_response_tokens:
            return "too_long", (
                f"response has {len(response_ids)} tokens > data.max_response_tokens={config.max_response_tokens}"
            )
    return Example(
        prompt=prompt,
        prompt_ids=np.asarray(prompt_ids, np.int32),
        response_ids=np.asarray(response_ids, np.int32),
        row=dict(row.data),
        where=row.where,
    )


def load_examples(
    files: Sequence[str], config: DataConfig, tokenizer, *, with_response: bool = False
) -> tuple[list[Example], LoadReport]:
    """Reads, validates and tokenises every row; bad rows are skipped with a warning naming file and row.

    Raises ``AllRowsBadError`` when no row is usable, ``ValueError`` when no file is given.
    """
    if not files:
        raise ValueError("no data files given; set data.train_files to a list of .jsonl/.parquet files")
    examples: list[Example] = []
    bad_by_reason: dict[str, int] = {}
    total = 0
    for path in files:
        for row in read_rows(path):
            total += 1
            result = _row_problem(row, config, tokenizer, with_response)
            if isinstance(result, Example):
                examples.append(result)
                continue
            reason, message = result
            bad_by_reason[reason] = bad_by_reason.get(reason, 0) + 1
            log.warning("skipping bad row: %s: %s", row.where, message)
    report = LoadReport(total_rows=total, bad_rows=total - len(examples), bad_by_reason=bad_by_reason)
    if not examples:
        raise AllRowsBadError(
            f"all {total} rows of {list(files)} are bad ({bad_by_reason}); check data.prompt_field="
            f"{config.prompt_field!r}, data.max_prompt_tokens={config.max_prompt_tokens} and the warnings above"
        )
    return examples, report


class BatchIterator:
    """Endless batches of Examples: sharded by process, seeded shuffle per epoch, resumable.

    batch_size: examples per batch on this process. ``state()`` returns a plain dict;
    ``restore(state)`` continues exactly from there.
    """

    def __init__(
        self,
        examples: Sequence[Example],
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        process_index: int = 0,
        process_count: int = 1,
    ):
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index={process_index} must be in [0, process_count={process_count})")
        shard = grain.MapDataset.range(len(examples))[process_index::process_count]
        if len(shard) < batch_size:
            raise ValueError(
                f"batch_size={batch_size} exceeds the {len(shard)} examples of process {process_index} "
                f"({len(examples)} valid rows over {process_count} processes); lower the batch size or add data"
            )
        if shuffle:
            shard = shard.shuffle(seed=seed)
        dataset = shard.repeat(None).batch(batch_size, drop_remainder=True, batch_fn=np.asarray)
        self.examples = list(examples)
        self._iterator = iter(dataset.to_iter_dataset())

    def __iter__(self):
        return self

    def __next__(self) -> list[Example]:
        return [self.examples[i] for i in next(self._iterator)]

    def state(self) -> dict:
        return dict(self._iterator.get_state())

    def restore(self, state: dict) -> None:
        self._iterator.set_state(dict(state))
