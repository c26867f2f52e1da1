"""Runs an experiment's grid: the demo's SFT warm-up once, then every cell x seed as a user's run.

A cell is one level of each of the experiment's axes (``configs/experiments/NAME.yaml``). Its
run is ``RLTrainer`` on ``configs/demo.yaml`` with, in order, the overrides of
``configs/experiments/common.yaml``'s ``rl``, the experiment's ``rl``, and the cell's levels;
a level may also name an ``engine`` (``jaxrl.rollout.mismatch.MismatchEngine``'s kind and
options), handed to the trainer as any caller's engine would be. Nothing else differs from
``jaxrl train``: no special code path.

The output folder holds ``demo/`` (data, tokenizer, the SFT model), ``runs/CELL/seedN/`` (each
run's ``metrics.jsonl``), ``runs.json`` (per run: the cell, seed, held-out rewards, seconds)
and what the experiment's report writes.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time

import yaml

from jaxrl.demo import CONFIG_DIR, run_sft, write_demo_files
from jaxrl.trainer.lifecycle import StopSignals, TrainingInterrupted

EXPERIMENT_CONFIGS = os.path.join(CONFIG_DIR, "experiments")


@dataclasses.dataclass(frozen=True)
class Cell:
    """One point of the grid: ``levels`` maps each axis to its level's name."""

    name: str
    levels: dict[str, str]
    overrides: dict
    engine: dict | None


def load_spec(name: str) -> dict:
    """``common.yaml`` under ``NAME.yaml`` (the experiment's keys win; ``rl`` is merged)."""
    with open(os.path.join(EXPERIMENT_CONFIGS, "common.yaml")) as f:
        spec = yaml.safe_load(f)
    with open(os.path.join(EXPERIMENT_CONFIGS, f"{name}.yaml")) as f:
        own = yaml.safe_load(f)
    spec["rl"] = {**spec["rl"], **own.pop("rl", {})}
    spec.update(own)
    return spec


def cells(spec: dict, axes: tuple[str, ...], quick: bool) -> list[Cell]:
    """The grid's cells: the product of ``axes``' levels, less what ``only`` excludes (a level of
    the first axis restricted to some levels of the second); with ``quick``, the ``quick`` subset."""
    levels = [list(spec[axis]) for axis in axes]
    if quick:
        subset = spec["quick"]
        levels = [[lv for lv in names if lv in subset.get(axis, names)]
                  for axis, names in zip(axes, levels, strict=True)]
    only = spec.get("only", {})
    out = []
    for combo in itertools.product(*levels):
        if len(axes) > 1 and combo[0] in only and combo[1] not in only[combo[0]]:
            continue
        overrides, engine = {}, None
        for axis, level in zip(axes, combo, strict=True):
            options = dict(spec[axis][level] or {})
            engine = options.pop("engine", engine)
            overrides.update(options)
        out.append(Cell("/".join(combo), dict(zip(axes, combo, strict=True)), overrides, engine))
    return out


def _override_list(overrides: dict) -> list[str]:
    def text(value):
        if value is None or value == "":
            return ""
        return json.dumps(value) if isinstance(value, (bool, list, dict)) else str(value)

    return [f"{key}={text(value)}" for key, value in overrides.items()]


def prepare(out: str, setup: dict) -> str:
    """The demo data and the SFT warm-up under ``out/demo`` (reused when already there); returns that root."""
    root = os.path.join(out, "demo")
    if not os.path.exists(os.path.join(root, "sft", "hf", "config.json")):
        write_demo_files(root, max_operand=setup["max_operand"], heldout=setup["heldout"])
        run_sft(root, [f"sft.stages=[{{steps: {setup['sft_steps']}, max_length: 16}}]", "logging.progress=false",
                       "logging.tensorboard=false", "logging.plots=false"])
    return root


def run_config(root: str, spec: dict, cell: Cell, seed: int, steps: int, run_dir: str, extra: dict | None = None):
    """The TrainConfig of one run: configs/demo.yaml, then the common, experiment and cell overrides."""
    from jaxrl.config import load_config
    from jaxrl.trainer.config import TrainConfig

    paths = {"data.tokenizer": f"{root}/tokenizer", "data.train_files": [f"{root}/data/train.jsonl"],
             "data.eval_files": [f"{root}/data/heldout.jsonl"], "model.hf_path": f"{root}/sft/hf"}
    overrides = {**paths, **spec["rl"], **cell.overrides, "steps": steps, "seed": seed, "data.seed": seed + 1,
                 "output_dir": run_dir, **(extra or {})}
    return load_config(TrainConfig, os.path.join(CONFIG_DIR, "demo.yaml"), _override_list(overrides))


def _engine(config, options: dict, seed: int):
    """The cell's MismatchEngine over the run's initial model, sized as the trainer sizes its own."""
    from jaxrl.models import make_mesh
    from jaxrl.rollout.mismatch import MismatchEngine
    from jaxrl.trainer.model import build_model

    mesh = make_mesh(config.mesh)
    rows = max(config.rollout.prompts_per_step * config.rollout.group_size,
               config.eval.max_prompts * config.eval.samples)
    options = dict(options)
    return MismatchEngine(build_model(config.model, mesh), options.pop("kind"), seed=seed, mesh=mesh,
                          max_batch=rows, **options)


def run_cell(root: str, spec: dict, cell: Cell, seed: int, steps: int, out: str, extra: dict | None = None) -> dict:
    """One run of ``cell`` with ``seed``; returns its record for runs.json (also written to the
    run's folder as record.json). A record already there from a run with the same settings is
    returned as it is: a grid stopped part-way (a crash, a kill) continues where it stopped."""
    from jaxrl.trainer.rl import RLTrainer

    run_dir = os.path.join(out, "runs", *cell.name.split("/"), f"seed{seed}")
    config = run_config(root, spec, cell, seed, steps, run_dir, extra)
    settings = {**spec["rl"], **cell.overrides, "engine": cell.engine, "steps": steps, **(extra or {})}
    saved = os.path.join(run_dir, "record.json")
    if os.path.exists(saved):
        try:
            with open(saved) as f:
                record = json.load(f)
        except ValueError:  # a run killed mid-write: run it again
            record = {}
            print(f"[experiment] {saved} is not readable JSON; running {cell.name} seed {seed} again")
        if record.get("settings") == json.loads(json.dumps(settings)):
            return {**record, "kept": True}
    start = time.perf_counter()
    engine = _engine(config, cell.engine, seed) if cell.engine else None
    trainer = RLTrainer(config, overwrite=True, engine=engine)
    try:
        summary = trainer.run()
    finally:
        trainer.close()
        if engine is not None:
            engine.close()
    record = {"cell": cell.name, "levels": cell.levels, "seed": seed, "steps": steps,
              "seconds": round(time.perf_counter() - start, 1), "metrics": summary["metrics"],
              "heldout_start": summary.get("heldout_start"), "heldout_end": summary.get("heldout_end"),
              "settings": settings}
    with open(saved, "w") as f:
        json.dump(record, f)
    return record


def run_grid(spec: dict, axes: tuple[str, ...], out: str, *, quick: bool, steps: int | None,
             log=print) -> tuple[str, list[dict]]:
    """Every cell x seed of the grid; returns (the demo root, the runs' records), also in out/runs.json.

    SIGTERM or SIGINT during a run stop it after its step (TrainingInterrupted); one that comes
    between two runs stops the grid before the next."""
    os.makedirs(out, exist_ok=True)
    seeds = spec["seeds"][:1] if quick else spec["seeds"]
    steps = int(steps or spec["steps"])
    records = []
    with StopSignals() as stop:
        start = time.perf_counter()
        root = prepare(out, spec["setup"])
        log(f"[experiment] SFT warm-up ready in {time.perf_counter() - start:.0f} s ({root}/sft/hf)")
        for cell, seed in itertools.product(cells(spec, axes, quick), seeds):
            _stop_if_asked(stop)
            # The KL experiment's gradient study reads one run's final policy: that run exports it.
            export = os.path.join(out, "runs", *cell.name.split("/"), f"seed{seed}", "hf")
            wanted = cell.name == spec.get("gradient_policy") and seed == seeds[0]
            record = run_cell(root, spec, cell, seed, steps, out, {"checkpoint.export_hf": export} if wanted else None)
            if wanted:
                record["export"] = export
            records.append(record)
            record.setdefault("kept", False)
            kept = " (kept from an earlier run into this folder)" if record["kept"] else ""
            log(f"[experiment] {cell.name} seed {seed}: held-out {record['heldout_start']:.3f} -> "
                f"{record['heldout_end']:.3f} in {record['seconds']:.0f} s{kept}")
        _stop_if_asked(stop)
    with open(os.path.join(out, "runs.json"), "w") as f:
        json.dump(records, f, indent=1)
    return root, records


def _stop_if_asked(stop: StopSignals) -> None:
    signum = stop.requested()
    if signum is not None:
        raise TrainingInterrupted(signum, 0, "")


__all__ = ["Cell", "cells", "load_spec", "prepare", "run_cell", "run_config", "run_grid"]
