"""The papers' findings as runnable experiments: ``jaxrl experiment NAME`` (docs/experiments.md).

``registry``: the three experiments (mismatch collapse, entropy collapse, KL estimators), one
declaration each. ``runner``: the demo's SFT warm-up once, then every cell x seed of a grid as
an ordinary ``RLTrainer`` run from ``configs/demo.yaml`` plus the cell's overrides. ``report``:
the figures, the verdicts and ``report.md``. ``kl``: the KL estimators' gradients on trainer
batches and the Gaussian table.
"""
