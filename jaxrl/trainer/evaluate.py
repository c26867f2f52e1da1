"""``jaxrl eval CONFIG`` and ``jaxrl filter CONFIG`` (docs/evaluation.md): a model from the training
config (or ``--hf`` / ``--checkpoint``), the config's rollout engine and reward router, and the
evaluation path of :mod:`jaxrl.evaluation`.

Exit status: 0 done; 2 a bad config, file, folder or row (one line naming it).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from typing import Sequence

import numpy as np

from jaxrl.config import ConfigError
from jaxrl.errors import InputError


def _parse(prog: str, argv: Sequence[str], what: str, extra) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"jaxrl {prog}", description=what,
                                     epilog="Overrides use the config's dotted keys, e.g. eval.samples=8.")
    parser.add_argument("config", help="a training config, YAML or JSON (see configs/)")
    parser.add_argument("overrides", nargs="*", help="optional key=value overrides")
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--hf", metavar="PATH", help="a Hugging Face folder to score instead of model.hf_path")
    model.add_argument("--checkpoint", metavar="DIR",
                       help="a training run's checkpoint folder (checkpoint.directory): its newest intact step's "
                            "parameters over the model section's architecture")
    extra(parser)
    if not argv:
        parser.print_help(sys.stderr)
        raise SystemExit(2)
    return parser.parse_intermixed_args(argv)  # options may come before or after the overrides


def _count(text: str) -> int:
    """A whole number >= 0, for argparse (which then names the option in its one-line error)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0")
    return value


def _restore_params(model, directory: str) -> int:
    """Loads the newest intact step's parameters of a training checkpoint into ``model``; returns
    the step. Only the parameters are read (the optimizer state stays on disk)."""
    import orbax.checkpoint as ocp
    from flax import nnx

    manager = ocp.CheckpointManager(os.path.abspath(directory))
    steps = sorted(manager.all_steps(), reverse=True)
    if not steps:
        raise InputError(f"--checkpoint {directory}: no checkpoint steps in this folder")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    abstract = _abstract(params)
    restored = manager.restore(steps[0], args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        {"params": abstract}, restore_args=ocp.checkpoint_utils.construct_restore_args({"params": abstract}),
        partial_restore=True)))
    nnx.update(model, restored["state"]["params"])
    manager.close()
    return steps[0]


def _abstract(tree):
    import jax

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class _Setup:
    """What both commands need: config, tokenizer, router, model, engine; ``close()`` releases them."""

    def __init__(self, prog: str, args: argparse.Namespace):
        from jaxrl.config import load_config
        from jaxrl.trainer.config import TrainConfig

        config = load_config(TrainConfig, args.config, args.overrides)
        if args.hf:
            config = dataclasses.replace(config, model=dataclasses.replace(config.model, hf_path=args.hf))
        self.config, self.args, self.prog = config, args, prog
        self.router = self.engine = self.manager = None

    def start(self, examples_files: Sequence[str], max_prompts: int | None, batch: int):
        from jaxrl.data import load_examples, load_tokenizer, stop_token_ids
        from jaxrl.models import make_mesh
        from jaxrl.rollout.config import make_engine
        from jaxrl.trainer.judges import build_reward_router
        from jaxrl.trainer.model import build_model, check_vocabulary, use_compile_cache

        config = self.config
        self.tokenizer = load_tokenizer(config.data.tokenizer)
        check_vocabulary(config.model, self.tokenizer, config.data.tokenizer)
        self.stop_token_ids = stop_token_ids(self.tokenizer, config.model.hf_path)
        self.router = build_reward_router(config)
        examples, self.report = load_examples(examples_files, config.data, self.tokenizer,
                                              row_check=self.router.row_problem)
        self.examples = examples[:max_prompts] if max_prompts else examples
        use_compile_cache(config.compile_cache_dir)
        mesh = make_mesh(config.mesh)
        model = build_model(config.model, mesh)
        self.model_source = config.model.hf_path or "random init"
        if self.args.checkpoint:
            step = _restore_params(model, self.args.checkpoint)
            self.model_source = f"{self.args.checkpoint} step {step}"
        self.engine, self.manager = make_engine(config.rollout, model, mesh, batch)
        if config.rollout.engine == "sglang" and self.args.checkpoint:
            self.engine.update_weights(model, version="checkpoint")  # servers start from model_path

    def sampling(self, temperature: float | None):
        from jaxrl.rollout.base import SamplingParams

        r = self.config.rollout
        return SamplingParams(temperature=r.temperature if temperature is None else temperature, top_p=r.top_p,
                              top_k=r.top_k, max_new_tokens=r.max_new_tokens,
                              stop_token_ids=self.stop_token_ids, seed=self.config.seed,
                              logprob_kind=r.logprob_kind)

    def encode(self, text: str) -> list[int]:
        """A prompt's token ids, encoded as the data section encodes the rows' prompts."""
        from jaxrl.data import encode_prompt

        d = self.config.data
        return encode_prompt(self.tokenizer, text, use_chat_template=d.use_chat_template, system_prompt=d.system_prompt)

    def close(self):
        for thing in (self.router, self.engine):
            if thing is not None:
                thing.close()
        if self.manager is not None:
            self.manager.stop()


def _run(prog: str, args, body) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        setup = _Setup(prog, args)
    except ConfigError as e:
        print(f"jaxrl {prog}: config error: {e}", file=sys.stderr)
        return 2
    try:
        return body(setup)
    except (InputError, FileNotFoundError, ValueError) as e:
        print(f"jaxrl {prog}: {e}", file=sys.stderr)
        return 2
    finally:
        setup.close()


def eval_main(argv: Sequence[str]) -> int:
    """Scores a model on ``data.eval_files``: avg@n and pass@k per task and overall; a table and JSON."""
    def extra(parser):
        parser.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")
        parser.add_argument("--max-prompts", type=_count, default=0, help="score only the first N prompts (0: all)")

    args = _parse("eval", argv, "score a model on held-out prompts (avg@n, pass@k)", extra)

    def body(setup: _Setup) -> int:
        from jaxrl.evaluation import evaluate
        from jaxrl.evaluation.self_verify import SelfVerifier
        from jaxrl.trainer.stages.rollout.episodes import environment_metrics

        e = setup.config.eval
        if not setup.config.data.eval_files:
            raise InputError("data.eval_files is empty; set it to the held-out .jsonl/.parquet files to score")
        chunk = max(setup.config.rollout.prompts_per_step, 1)
        setup.start(setup.config.data.eval_files, args.max_prompts, chunk * e.samples)
        generate, played = _conversations(setup)
        verifier = None if e.self_verify is None else SelfVerifier(e.self_verify, setup.encode)
        result = evaluate(setup.engine, setup.router, setup.tokenizer, setup.examples, setup.sampling(e.temperature),
                          e.samples, e.k, chunk_prompts=chunk, generate=generate, self_verifier=verifier)
        result = dataclasses.replace(result, sampling={**result.sampling, "model": setup.model_source,
                                                       "files": list(setup.config.data.eval_files)},
                                     environment=environment_metrics(played))
        print(result.table())
        if args.json:
            result.write_json(args.json)
            print(f"results: {args.json}")
        return 0

    return _run("eval", args, body)


def _conversations(setup: _Setup):
    """(generate, played samples): with an ``env`` section, prompts are played as conversations
    with their environments, as the trainer's held-out evaluation plays them."""
    from jaxrl.env import EnvRouter
    from jaxrl.trainer.stages.rollout.episodes import recording_conversations

    envs = EnvRouter(setup.config.env, setup.tokenizer) if setup.config.env is not None else None
    return recording_conversations(setup.engine, envs)


def filter_main(argv: Sequence[str]) -> int:
    """Keeps the prompts whose pass rate lies in their task's band (the ``filter`` section)."""
    args = _parse("filter", argv, "keep the prompts whose pass rate lies in their task's band", lambda parser: None)

    def body(setup: _Setup) -> int:
        from jaxrl.evaluation.filter import run_filter

        f = setup.config.filter
        files = f.input_files or setup.config.data.train_files
        f.refuse_inputs_as_outputs(files)  # an empty or clashing filter.output fails before the model loads
        setup.start(files, None, f.chunk_prompts * f.samples)
        seed = setup.config.seed
        summary = run_filter(f, setup.examples, setup.engine, setup.router, setup.tokenizer,
                             setup.sampling(f.temperature), bad_rows=setup.report.bad_rows,
                             seed_of_chunk=lambda c: int(np.random.SeedSequence([seed, c]).generate_state(1)[0] >> 1),
                             generate=_conversations(setup)[0])
        for task, entry in sorted(summary["tasks"].items()):
            band = entry["band"]
            print(f"{task}: kept {entry['kept']}/{entry['in']} ({entry['kept_fraction']:.3f}) with "
                  f"{band['low']} < p <= {band['high']}")
        print(f"all: kept {summary['kept']}/{summary['in']} ({summary['kept_fraction']:.3f}) -> {f.output}; "
              f"summary {summary['files']['summary']}, histogram {summary['files']['histogram']}")
        return 0

    return _run("filter", args, body)
