"""The pass-rate filter (docs/evaluation.md#the-pass-rate-filter): keep the prompts a model solves
sometimes but not always.

Each prompt gets ``samples`` completions (Motif: 5) from the engine, scored by its task's reward;
its pass rate ``p`` is the fraction of them that are correct (reward > ``CORRECT_ABOVE``; an
unparsable or failed sample counts as wrong). The prompt is kept when ``low < p <= high`` for its
task's band (Motif: math (0, 0.8], instruction following (0, 0.4]): a prompt no sample solves
gives no learning signal to group-relative RL, and one solved (nearly) always teaches little.

Progress survives interruption: the prompts are scored in fixed chunks, and each finished chunk's
pass rates are appended to the progress file (JSONL, flushed and fsynced). A rerun reads it,
skips every prompt already there and scores only the rest; since the chunks and their sampling
seeds depend only on the input order, the resumed run's pass rates are the uninterrupted run's.
The kept rows, the summary and the histograms are written from the progress file at the end.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable, Sequence

import numpy as np

from jaxrl.data.pipeline import Example
from jaxrl.errors import InputError
from jaxrl.evaluation.core import CORRECT_ABOVE, sample_and_score, sampling_record
from jaxrl.reward.base import RewardRouter
from jaxrl.rollout.base import RolloutEngine, SamplingParams

@dataclasses.dataclass(frozen=True)
class PassBand:
    """Keep a prompt when ``low < p <= high`` (Motif's half-open ``(low, high]``): ``low = 0``
    drops the prompts no sample solves. ``low`` below 0 keeps those too."""

    low: float = 0.0
    high: float = 1.0

    def __post_init__(self):
        if not (-1.0 <= self.low < self.high <= 1.0):
            raise ValueError(f"a pass band needs -1 <= low < high <= 1 (kept: low < p <= high), "
                             f"got low={self.low}, high={self.high}")

    def keeps(self, p: float) -> bool:
        return self.low < p <= self.high


@dataclasses.dataclass(frozen=True)
class FilterConfig:
    """``jaxrl filter``'s section.

    input_files: the .jsonl/.parquet files to filter (empty: ``data.train_files``). output: the
    kept rows, .jsonl or .parquet (by its suffix), every input field plus ``pass_rate_field``.
    samples: completions per prompt. temperature: None = the rollout's. bands: task -> its
    ``{low, high}`` (kept when low < p <= high); default_band: for tasks without one (None: such a
    task is an error before anything is sampled). chunk_prompts: prompts per engine call and per
    progress record. progress / summary: the progress JSONL and the summary JSON (empty: next to
    ``output``, as ``OUTPUT.progress.jsonl`` and ``OUTPUT.summary.json``; the histograms go to
    ``OUTPUT.hist.png``).
    """

    input_files: tuple[str, ...] = ()
    output: str = ""
    samples: int = 5
    temperature: float | None = None
    bands: dict[str, PassBand] = dataclasses.field(
        default_factory=lambda: {"math": PassBand(0.0, 0.8), "instruction_following": PassBand(0.0, 0.4)})
    default_band: PassBand | None = None
    chunk_prompts: int = 64
    pass_rate_field: str = "pass_rate"
    progress: str = ""
    summary: str = ""

    def __post_init__(self):
        if self.output and not self.output.endswith((".jsonl", ".parquet")):
            raise ValueError(f"filter.output={self.output!r} must end in .jsonl or .parquet")
        if self.samples < 1 or self.chunk_prompts < 1:
            raise ValueError(f"filter.samples ({self.samples}) and filter.chunk_prompts ({self.chunk_prompts}) "
                             f"must be >= 1")

    def paths(self) -> dict[str, str]:
        if not self.output:
            raise ValueError("filter.output is empty; set it to the kept rows' file (.jsonl or .parquet)")
        return {"output": self.output, "progress": self.progress or self.output + ".progress.jsonl",
                "summary": self.summary or self.output + ".summary.json", "histogram": self.output + ".hist.png"}

    def refuse_inputs_as_outputs(self, inputs: Sequence[str]) -> None:
        """Refuses a run whose output, progress, summary or histogram file is one of ``inputs``
        (compared as resolved paths, links and hard links included): writing it would replace the
        rows being filtered with the kept ones."""
        for name, path in self.paths().items():
            for source in inputs:
                same = os.path.realpath(path) == os.path.realpath(source) or (
                    os.path.exists(path) and os.path.exists(source) and os.path.samefile(path, source))
                if same:
                    chosen = {"output": self.output, "progress": self.progress, "summary": self.summary}.get(name)
                    key = f"filter.{name}" if chosen else f"the {name} file next to filter.output"
                    raise InputError(f"{key} is {path}, which is the input file {source}: the filter would "
                                     f"overwrite the rows it reads; write the kept rows to another file")

    def band(self, task: str) -> PassBand:
        band = self.bands.get(task, self.default_band)
        if band is None:
            raise ValueError(f"filter: task {task!r} has no pass band; add filter.bands.{task}: {{low: L, high: H}} "
                             f"or set filter.default_band (bands: {sorted(self.bands)})")
        return band


def _read_progress(path: str, settings: dict) -> dict[str, dict]:
    """prompt id -> its record, from an earlier run's progress file (empty when there is none).
    A file written with other sampling settings is refused: its pass rates are not comparable."""
    if not os.path.exists(path):
        return {}
    done: dict[str, dict] = {}
    with open(path) as f:
        lines = f.read().splitlines()
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # a record cut short by the interruption: its chunk is redone
                break
            raise ValueError(f"filter progress file {path} line {number} is not JSON; delete the file to start "
                             f"afresh") from None
        if "settings" in record:
            if record["settings"] != settings:
                raise ValueError(f"filter progress file {path} was written with {record['settings']}, this run "
                                 f"samples with {settings}; delete it (or set filter.progress) to start afresh")
            continue
        done[record["id"]] = record
    return done


def _append(path: str, records: Sequence[dict]) -> None:
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
        f.flush()
        os.fsync(f.fileno())


def _write_rows(path: str, rows: list[dict]) -> None:
    """The kept rows, written to a temporary file and renamed, so a reader never sees half of them."""
    tmp = path + ".tmp"
    if path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), tmp)
    else:
        with open(tmp, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)


def _write_summary(path: str, summary: dict) -> None:
    """The summary JSON, written whole or not at all (a temporary file renamed over it)."""
    with open(path + ".tmp", "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    os.replace(path + ".tmp", path)


def _histogram(path: str, rates: dict[str, list[float]], config: FilterConfig) -> None:
    """One panel per task: prompts per pass rate (one bar per possible value c/n), the band shaded."""
    from jaxrl.plotting import pyplot, save_figure

    plt = pyplot()

    n = config.samples
    fig, axes = plt.subplots(1, len(rates), figsize=(4 * len(rates), 3), squeeze=False)
    for ax, (task, values) in zip(axes[0], sorted(rates.items()), strict=True):
        band = config.band(task)
        ax.bar(np.arange(n + 1) / n, _counts(values, n), width=0.8 / n, color="tab:blue")
        ax.axvspan(max(band.low, 0.0), band.high, color="tab:green", alpha=0.15,
                   label=f"kept: ({band.low}, {band.high}]")
        ax.set(title=f"{task}: {len(values)} prompts", xlabel=f"pass rate ({n} samples)", ylabel="prompts")
        ax.legend(fontsize=7)
    save_figure(fig, path, dpi=100)


def _counts(rates: Sequence[float], n: int) -> list[int]:
    """Prompts per number of correct samples c = 0..n (pass rate c/n)."""
    return np.bincount(np.rint(np.asarray(rates) * n).astype(int), minlength=n + 1).tolist()


def run_filter(config: FilterConfig, examples: Sequence[Example], engine: RolloutEngine, router: RewardRouter,
               tokenizer, params: SamplingParams, *, seed_of_chunk: Callable[[int], int],
               bad_rows: int = 0, on_error: Callable[[str], None] | None = None,
               log: Callable[[str], None] = print, generate=None) -> dict:
    """Scores every prompt not yet in the progress file, then writes the kept rows, the summary
    and the histograms; returns the summary. Chunk ``c`` samples with ``params`` and the seed
    ``seed_of_chunk(c)`` (``params.seed`` is the recorded run seed it derives from).
    ``bad_rows``: input rows the loader skipped (reported). ``generate``: how samples are made
    (``sample_and_score``'s; e.g. conversations with environments), default the engine's."""
    paths = config.paths()
    tasks = [router.task_of(e.row) for e in examples]
    for task in sorted(set(tasks)):
        config.band(task)  # a task without a band fails now, before any sampling
    settings = sampling_record(params, config.samples)  # chunk c samples with seed_of_chunk(c)
    done = _read_progress(paths["progress"], settings)
    if not os.path.exists(paths["progress"]):
        _append(paths["progress"], [{"settings": settings}])
    ids = [e.where for e in examples]
    if len(set(ids)) != len(ids):
        raise ValueError("filter: two input rows share a location; give each input file once")
    size = config.chunk_prompts
    chunks = [range(s, min(s + size, len(examples))) for s in range(0, len(examples), size)]
    todo = [(c, chunk) for c, chunk in enumerate(chunks) if any(ids[i] not in done for i in chunk)]
    if done:
        log(f"[filter] resuming: {len(done)} prompts already scored, {sum(len(ch) for _, ch in todo)} to go")
    for number, (c, chunk) in enumerate(todo, 1):
        part = [examples[i] for i in chunk]
        chunk_params = dataclasses.replace(params, seed=seed_of_chunk(c))
        _, scored = sample_and_score(engine, router, tokenizer, part, chunk_params, config.samples, on_error,
                                     generate)
        correct = (scored.scores > CORRECT_ABOVE).reshape(len(part), config.samples).sum(axis=1)
        records = [{"id": ids[i], "task": tasks[i], "correct": int(k), "n": config.samples,
                    "pass_rate": int(k) / config.samples} for i, k in zip(chunk, correct, strict=True)]
        _append(paths["progress"], records)
        done.update((r["id"], r) for r in records)
        log(f"[filter] chunk {number}/{len(todo)}: {len(done)}/{len(examples)} prompts scored")
    kept, rates, summary = [], {}, {}
    for e, task, i in zip(examples, tasks, ids, strict=True):
        p = done[i]["pass_rate"]
        rates.setdefault(task, []).append(p)
        entry = summary.setdefault(task, {"in": 0, "kept": 0, "band": dataclasses.asdict(config.band(task))})
        entry["in"] += 1
        if config.band(task).keeps(p):
            entry["kept"] += 1
            kept.append({**e.row, config.pass_rate_field: p})
    for task, entry in summary.items():
        entry["kept_fraction"] = entry["kept"] / entry["in"]
        counts = _counts(rates[task], config.samples)
        entry["histogram"] = {f"{c}/{config.samples}": count for c, count in enumerate(counts)}
    _write_rows(paths["output"], kept)
    _histogram(paths["histogram"], rates, config)
    result = {"in": len(examples), "kept": len(kept), "kept_fraction": len(kept) / len(examples),
              "bad_rows": bad_rows, "sampling": settings, "tasks": summary, "rule": "kept when low < p <= high",
              "files": paths}
    _write_summary(paths["summary"], result)
    return result
