"""Every shipped TPU config compiles for its intended topology and fits each chip's HBM, proved on this CPU.

Runs ``jaxrl compile`` (in ``.venv-tpu``: ``bash scripts/setup_tpu_aot.sh``) for each config below on
its slice, prints the per-device table and one line per config:

    TARGET <config>: fits with <X> GiB headroom (goal fits) met|missed

where X is the smallest headroom over the step's programs. Nothing runs on a TPU: step times need one.

    python bench/tpu_aot.py [--only qwen3_8b]
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
TPU_PYTHON = ROOT / ".venv-tpu" / "bin" / "python"
GIB = 2.0 ** 30
# (config, the topology its hardware line names)
SHIPPED = [("configs/qwen3_8b_grpo_tpu_pod.yaml", "v5p:4x4x2"),        # v5p-64: 32 chips
           ("configs/qwen3_30b_a3b_grpo_tpu_pod.yaml", "v5p:4x4x2"),
           ("configs/qwen3_8b_long_sft_tpu_pod.yaml", "v5p:4x4x2"),   # the 16K -> 64K SFT curriculum
           ("configs/qwen3_8b_long_grpo_tpu_pod.yaml", "v5p:4x4x2")]  # GRPO at 32K


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="", help="run the configs whose path contains this")
    args = parser.parse_args()
    if not TPU_PYTHON.exists():
        sys.exit("bench/tpu_aot.py needs .venv-tpu: bash scripts/setup_tpu_aot.sh")
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    lines = []
    for config, topology in SHIPPED:
        if args.only not in config:
            continue
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "report.json")
            done = subprocess.run([str(TPU_PYTHON), "-m", "jaxrl.cli", "compile", config, "--topology", topology,
                                   "--json", path], cwd=ROOT, env=env, capture_output=True, text=True)
            print(done.stdout, flush=True)
            if done.returncode not in (0, 1):
                print(done.stderr[-2000:])
                # A negative status is a signal: SIGKILL (-9) is how the kernel's OOM killer ends a compile
                # that needs more host memory than this machine has.
                why = (f"killed by signal {-done.returncode}" + (" (host out of memory?)" if done.returncode == -9
                                                                  else "")) if done.returncode < 0 \
                    else f"status {done.returncode}"
                lines.append(f"TARGET {config} on {topology}: compile failed, {why} (goal fits) missed")
                continue
            with open(path) as f:
                report = json.load(f)
        headroom = min(p["headroom_bytes"] for p in report["programs"]) / GIB
        measured = f"fits with {headroom:.2f} GiB headroom" if report["fits"] else f"does not fit ({headroom:.2f} GiB)"
        lines.append(f"TARGET {config} on {topology}: {measured} (goal fits) {'met' if report['fits'] else 'missed'}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
