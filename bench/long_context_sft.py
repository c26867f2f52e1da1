"""The 64K SFT stage end to end on 8 CPU devices, against the same step split differently.

    python bench/long_context_sft.py [--length 65536] [--vocab 151936] [--modes ulysses] [--reference ring]

Runs ``jaxrl.trainer.sft.SFTTrainer`` on the curriculum of tests/trainer/test_long_context.py
(``long_sft_config``: a 16-column stage, then one of ``--length`` columns holding one pair of
~``--length`` tokens; the test's tiny width, 1 layer, 2 heads; here with the real Qwen3 vocabulary
and the chunked LM head) on a ``sequence=8`` mesh, once per ``model.context_parallel`` mode. The
suite runs the same code at 16K with the test's small vocabulary.

``--reference`` (``ring`` by default, as in the test: key/value blocks passed around the devices)
splits the step another way than each of ``--modes`` (``ulysses``: an all-to-all from tokens to
heads; ``none``: XLA's partitioner on its own, much slower). For every mode it prints the two
steps' losses and the largest difference of the parameter changes (the optimizer step is Adam's
first, ``eps=1``: the gradient) relative to their scale, plus each run's wall time and the
process's peak resident memory. Ends with one TARGET line per compared mode (goal: within 1e-4 of
the reference's scale, the suite's bound for the same comparison).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import resource
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "trainer")]
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import suite_settings  # noqa: E402  (8 host devices, the collectives' timeout of a loaded machine)

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {suite_settings.xla_flags()}"

import numpy as np  # noqa: E402

from jaxrl.demo import write_demo_files  # noqa: E402
from jaxrl.trainer.metrics import read_jsonl  # noqa: E402
from jaxrl.trainer.sft import SFTTrainer  # noqa: E402
from test_long_context import _train, long_sft_config  # noqa: E402

GOAL = 1e-4


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=65_536)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--modes", default="ulysses")
    parser.add_argument("--reference", default="ring")
    args = parser.parse_args()
    modes = [args.reference] + [mode for mode in args.modes.split(",") if mode != args.reference]
    root = pathlib.Path(tempfile.mkdtemp(prefix="long-sft-"))
    files = write_demo_files(str(root / "demo"), max_operand=10, heldout=10)
    print(f"SFT stage of {args.length} columns, vocab {args.vocab}, 8 CPU devices, mesh.sequence=8")
    results = {}
    for mode in modes:
        start = time.perf_counter()
        changes, _ = _train(SFTTrainer, long_sft_config(files, root / mode, args.length, mode, args.vocab))
        rows = read_jsonl(str(root / mode / "metrics.jsonl"))
        results[mode] = changes, rows
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
        print(f"{mode:>8}: {time.perf_counter() - start:6.0f} s (both stages), long stage loss "
              f"{rows[-1]['update/loss']:.6f} on {rows[-1]['sft/tokens']} tokens, peak RSS so far {peak:.1f} GiB")
    reference = results[args.reference][0]
    scale = max(float(np.max(np.abs(c))) for c in reference)
    for mode in modes[1:]:
        difference = max(float(np.max(np.abs(a - b))) for a, b in zip(reference, results[mode][0], strict=True))
        loss_gap = abs(results[mode][1][-1]["update/loss"] - results[args.reference][1][-1]["update/loss"])
        print(f"{mode} vs {args.reference}: loss difference {loss_gap:.2e}, parameter changes differ by "
              f"{difference / scale:.2e} of their scale ({scale:.3e}); per parameter (shape: max difference, "
              f"max change):")
        for a, b in zip(reference, results[mode][0], strict=True):
            print(f"  {a.shape}: {float(np.max(np.abs(a - b))):.3e}, {float(np.max(np.abs(a))):.3e}")
        print(f"TARGET sft_{args.length // 1024}k_{mode}_update_equals_reference: {difference / scale:.2e} "
              f"(goal <= {GOAL:.0e}) {'met' if difference <= GOAL * scale else 'missed'}")


if __name__ == "__main__":
    main()
