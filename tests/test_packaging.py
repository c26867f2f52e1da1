"""The package as users get it: a wheel and an sdist that build and pass ``twine check``, a wheel
that holds ``jaxrl`` only, and a base install (no extras) on which ``jaxrl.losses`` works alone.

The base-install test builds a fresh venv and installs the wheel with its two dependencies (jax,
numpy) at the versions of requirements.txt, which scripts/setup.sh installed through the same pip
cache, so it downloads nothing after the first run (measured on 2 cores: 11 s for the build, 36 s for
the venv, its install and the checks).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Run inside the fresh venv: the losses on random arrays, then what the base install must not have
# pulled in, then the one-line message of a package that needs the [train] extra.
_BASE_INSTALL_CHECK = textwrap.dedent("""
    import sys

    import numpy as np

    from jaxrl import losses

    rng = np.random.default_rng(0)
    rewards = rng.normal(size=8).astype(np.float32)
    mask = np.ones((8, 5), np.float32)
    adv, _ = losses.grpo_advantages(rewards, group_size=4)
    logp = rng.normal(size=(8, 5)).astype(np.float32) - 2.0
    loss, metrics = losses.rl_objective(losses.ObjectiveConfig(policy_loss="gspo"), logp, logp,
                                        losses.broadcast_to_tokens(adv, mask), mask,
                                        normalizer=losses.loss_normalizer("token-mean", mask))
    assert np.isfinite(float(loss)), loss
    assert metrics, "rl_objective returned no metrics"
    imported = {name.partition(".")[0] for name in sys.modules}
    unwanted = sorted(imported & {"flax", "transformers", "orbax", "grain", "torch", "optax", "yaml"})
    assert not unwanted, f"import jaxrl.losses pulled in {unwanted}"
    try:
        import jaxrl.models  # noqa: F401
    except ModuleNotFoundError as error:
        print("MODELS:", error)
    else:
        raise AssertionError("jaxrl.models imported without the [train] extra")
""")


def _run(*args, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{args} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, pathlib.Path]:
    """The sdist, and the wheel built from it (``python -m build``'s default order); ``src``: the copy built."""
    # Built from a copy: setuptools writes jaxrl.egg-info into the tree it builds.
    src, out = tmp_path_factory.mktemp("src") / "jaxrl", tmp_path_factory.mktemp("dist")
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "runs", "out", "__pycache__", "*.egg-info", ".ruff_cache", ".pytest_cache"))
    _run(sys.executable, "-m", "build", "--outdir", out, src)
    (wheel,), (sdist,) = out.glob("*.whl"), out.glob("*.tar.gz")
    return {"wheel": wheel, "sdist": sdist, "src": src}


def test_wheel_holds_the_package_only(dist):
    import jaxrl

    assert dist["wheel"].name.startswith(f"jaxrl-{jaxrl.__version__}-")
    names = zipfile.ZipFile(dist["wheel"]).namelist()
    outside = sorted({n.split("/")[0] for n in names} - {"jaxrl", f"jaxrl-{jaxrl.__version__}.dist-info"})
    assert not outside, f"the wheel holds more than the package: {outside}"
    # Every module of the source tree, the namespace package jaxrl/rollout (no __init__.py) included.
    expected = {p.relative_to(ROOT).as_posix() for p in (ROOT / "jaxrl").rglob("*.py")}
    assert expected <= set(names), sorted(expected - set(names))


def test_the_readme_wheel_command_builds_the_same_package(dist, tmp_path):
    """``pip wheel --no-deps -w dist .`` (README, docs/install.md) from a checkout gives the wheel ``build`` does."""
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps", "-w", tmp_path, ".",
         cwd=dist["src"])
    (wheel,) = tmp_path.glob("*.whl")
    assert wheel.name == dist["wheel"].name
    assert sorted(zipfile.ZipFile(wheel).namelist()) == sorted(zipfile.ZipFile(dist["wheel"]).namelist())


def test_twine_check(dist):
    result = _run(sys.executable, "-m", "twine", "check", "--strict", dist["wheel"], dist["sdist"])
    assert result.stdout.count("PASSED") == 2, result.stdout


def _locked(names: set[str], lock: str = "requirements.txt") -> list[str]:
    """The lock's pins of ``names`` (its ``-r`` files followed), without extras (a constraints file may
    not have them)."""
    pins = []
    for line in (ROOT / lock).read_text().splitlines():
        if line.startswith("-r "):
            pins += _locked(names, line[3:].strip())
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^]]*\])?(==\S+)", line.strip())
        if match and match[1].lower() in names:
            pins.append(match[1] + match[3])
    return pins


def test_base_install_runs_the_losses_alone(dist, tmp_path):
    # The fresh venv must see its own site-packages only, not a source tree on PYTHONPATH; cwd is
    # tmp_path for the same reason.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv)
    bindir = venv / ("Scripts" if sys.platform == "win32" else "bin")
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("\n".join(_locked({"jax", "jaxlib", "numpy"})) + "\n")
    _run(bindir / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c", constraints,
         dist["wheel"], env=env, cwd=tmp_path)
    check = _run(bindir / "python", "-c", _BASE_INSTALL_CHECK, env=env, cwd=tmp_path)
    assert ('needs the [train] extra (flax is not installed): pip install ".[train]" in the jaxrl repository '
            '(docs/install.md)') in check.stdout

    version = dist["wheel"].name.split("-")[1]
    assert _run(bindir / "jaxrl", "--version", env=env, cwd=tmp_path).stdout.strip() == f"jaxrl {version}"
    # Every command, with the arguments a user would give: some import their modules only once running.
    from jaxrl.cli import COMMANDS

    arguments = {"demo": [], "experiment": ["kl"], "compile": ["x.yaml", "--topology", "v5e:2x2"]}
    for name in COMMANDS:
        run = subprocess.run([bindir / "jaxrl", name, *arguments.get(name, ["x.yaml"])], capture_output=True,
                             text=True, env=env, cwd=tmp_path)
        assert run.returncode == 2, (name, run.returncode, run.stdout, run.stderr)
        assert re.fullmatch(rf'jaxrl {name} needs the \[train\] extra \([\w.]+ is not installed\): '
                            r'pip install "\.\[train\]" in the jaxrl repository \(docs/install\.md\)',
                            run.stderr.strip()), (name, run.stderr)


def test_needs_extra_names_the_extra_and_passes_other_errors():
    from jaxrl.errors import MissingExtraError, needs_extra

    with pytest.raises(MissingExtraError, match=r'^jaxrl.models needs the \[train\] extra \(flax.nnx is not '
                                                 r'installed\): pip install "\.\[train\]" in the jaxrl repository '
                                                 r'\(docs/install\.md\)$') as caught:
        with needs_extra("jaxrl.models"):
            raise ModuleNotFoundError("No module named 'flax.nnx'", name="flax.nnx")
    assert caught.value.name == "flax.nnx" and caught.value.extra == "train"
    with pytest.raises(ModuleNotFoundError) as caught:  # not an extra's module: a bug, left as it is
        with needs_extra("jaxrl.models"):
            raise ModuleNotFoundError("No module named 'jaxrl.modles'", name="jaxrl.modles")
    assert not isinstance(caught.value, MissingExtraError)


def test_version_has_one_source(capsys):
    import jaxrl
    from jaxrl import cli

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"jaxrl {jaxrl.__version__}\n"
    assert 'dynamic = ["version"]' in (ROOT / "pyproject.toml").read_text()


def test_the_gpu_lock_installs_jax_on_cuda_and_the_runtime_without_test_tools(tmp_path):
    """requirements-cuda.txt (what scripts/setup_gpu.sh installs on a GPU host) resolves with pip on
    this platform: JAX's CUDA 12 plugin at the lock's JAX version, the runtime pins of the CPU lock,
    torch (the in-memory weight push), and none of the test tools. A dry run: pip resolves from
    PyPI's metadata and installs nothing."""
    report = tmp_path / "report.json"
    _run(sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q", "--report", report,
         "-r", ROOT / "requirements-cuda.txt")
    chosen = {item["metadata"]["name"].lower(): item["metadata"]["version"]
              for item in json.loads(report.read_text())["install"]}
    jax_version = _locked({"jax"})[0].split("==")[1]
    assert chosen["jax"] == chosen["jaxlib"] == chosen["jax-cuda12-plugin"] == jax_version
    assert chosen["jax-cuda12-pjrt"] == jax_version and "nvidia-cuda-runtime-cu12" in chosen
    runtime = {"flax", "optax", "orbax-checkpoint", "transformers", "numpy", "torch"}
    for pin in _locked(runtime, "requirements-runtime.txt"):
        name, version = pin.lower().split("==")
        assert chosen[name].split("+")[0] == version, pin
    assert not {"pytest", "pytest-xdist", "pytest-timeout", "ruff", "build", "twine"} & set(chosen)
    # The GPU servers' SGLang is the version the CPU tests run.
    (cpu_sglang,) = [line for line in (ROOT / "scripts/sglang_cpu/requirements-cpu.lock").read_text().splitlines()
                     if line.startswith("sglang==")]
    assert f'SGLANG="sglang[all]=={cpu_sglang.split("==")[1]}"' in (ROOT / "scripts/setup_gpu.sh").read_text()
