"""Ahead-of-time compilation for TPU pod topologies without a TPU: ``jaxrl compile`` (docs/tpu.md).

- :mod:`jaxrl.compile.presets`: the architecture shapes of shipped configs whose weights are not on disk;
- :mod:`jaxrl.compile.aot`: the programs one RL step runs (train step, scorers, embedded sampler),
  lowered from the trainer's own functions with abstract shapes over a topology's devices, compiled;
- :mod:`jaxrl.compile.report`: per-chip memory against HBM, FLOPs, the roofline, the verdict;
- :mod:`jaxrl.compile.cli`: the command.
"""
