"""``jaxrl align``: the logprob-alignment checker on the command line.

  jaxrl align report DUMP.npz --out DIR [gate options]
      metrics, figures and gate for a batch dump saved by the trainer.
  jaxrl align run --model HF_DIR --prompts PROMPTS.jsonl --out DIR [sampling] [gate options]
      samples with the embedded JAX sampler, recomputes with the learner, then as `report`.
  jaxrl align localize --model HF_DIR --prompts PROMPTS.jsonl --out DIR --path PATH
      diffs activations module by module, layer by layer between two paths.

Exit status: 0 when the gate passes (or none is set), 1 when it fails or a
module exceeds the localisation tolerance, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxrl.align.gate import GATEABLE, Gate


def _add_gate_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("gate (exit 1 when a limit is exceeded)")
    g.add_argument("--max-k3", type=float, help="limit on the k3 mismatch (vllm-kl)")
    g.add_argument("--max-abs-log-ratio", type=float, help="limit on max |learner logp - rollout logp|")
    g.add_argument("--max-frac-outside-band", type=float,
                   help="limit on the fraction of tokens whose ratio is outside --ratio-band")
    g.add_argument("--limit", action="append", default=[], metavar="METRIC=VALUE",
                   help=f"any other limit; METRIC one of {', '.join(GATEABLE)}")
    g.add_argument("--ratio-band", type=float, nargs=2, default=(0.5, 2.0), metavar=("LOW", "HIGH"),
                   help="ratio band for frac_outside_ratio_band (default 0.5 2)")
    p.add_argument("--no-figures", action="store_true", help="skip the PNG figures")


def _gate_from_args(args) -> Gate | None:
    limits = {}
    for name, value in (("k3", args.max_k3), ("abs_log_ratio_max", args.max_abs_log_ratio),
                        ("frac_outside_ratio_band", args.max_frac_outside_band)):
        if value is not None:
            limits[name] = value
    for item in args.limit:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--limit {item!r} must look like METRIC=VALUE")
        try:
            limits[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--limit {item!r}: {value!r} is not a number") from None
    return Gate(limits) if limits else None


def _finish(batch, args) -> int:
    from jaxrl.align.report import write_report

    _, result, summary = write_report(batch, args.out, gate=_gate_from_args(args),
                                      ratio_band=tuple(args.ratio_band), figures=not args.no_figures)
    print(summary)
    print(f"written to {args.out}")
    return 0 if result is None or result.passed else 1


def _cmd_report(args) -> int:
    from jaxrl.align.dump import AlignmentBatch

    return _finish(AlignmentBatch.load(args.dump), args)


def _read_prompts(path: str) -> list[list[int]]:
    """JSON lines, each a list of token ids or an object with "prompt_ids"."""
    prompts = []
    with open(path) as f:
        for row, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {row}: not JSON ({e})") from None
            ids = item.get("prompt_ids") if isinstance(item, dict) else item
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise ValueError(f"{path} line {row}: expected a non-empty list of token ids "
                                 "(or {\"prompt_ids\": [...]}), got {line.strip()[:80]!r}")
            prompts.append(ids)
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxrl align", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("report", help="metrics, figures and gate for a batch dump")
    p.add_argument("dump", help=".npz written by jaxrl.align.AlignmentBatch.save")
    p.add_argument("--out", required=True, help="output folder")
    _add_gate_options(p)
    p.set_defaults(run=_cmd_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"jaxrl align: {e}", file=sys.stderr)
        return 2
