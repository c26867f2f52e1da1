"""The logprob-alignment checker: does a rollout engine assign the learner's probabilities?

Library API: ``AlignmentBatch`` (the compared batch and its .npz dump),
``build_report`` / ``format_summary`` (docs/alignment.md#metrics metrics), ``Gate``,
``write_report`` (JSON, text, PNGs), ``jaxrl.align.check`` (run an engine and
the learner) and ``jaxrl.align.localize`` (module-by-module activation diffs).
"""

from jaxrl.errors import needs_extra

# Without the [train] extra an import below names that extra instead of a bare missing module.
with needs_extra("jaxrl.align"):
    from jaxrl.align.dump import AlignmentBatch
    from jaxrl.align.gate import Gate, GateResult
    from jaxrl.align.metrics import build_report, format_summary
    from jaxrl.align.report import write_report

__all__ = ["AlignmentBatch", "Gate", "GateResult", "build_report", "format_summary", "write_report"]
