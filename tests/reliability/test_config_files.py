"""Config files a user (or a copied example) may get wrong: aliases that explode, a key given
twice, integers no consumer can take. Each is refused at load with one line naming it, exit 2."""

import json
import resource
import subprocess
import sys

import pytest

from jaxrl.config import ConfigError, MAX_CONFIG_VALUES, load_config, read_config_file
from jaxrl.trainer.config import TrainConfig

# Nine levels, each a list of nine aliases of the one before: 9**9 strings once written out.
LAUGHS = "a: &a [" + ",".join(['"lol"'] * 9) + "]\n" + "".join(
    f"{b}: &{b} [" + ",".join([f"*{a}"] * 9) + "]\n" for a, b in zip("abcdefgh", "bcdefghi", strict=True))


def _in_1_gib():
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


def test_billion_laughs_is_refused_without_expanding_it(tmp_path):
    """Before: the file's 9**9 = 387,420,489 strings were built by the deep copy of the overrides
    (1.6 GB and growing, no error). Now the expanded size is counted over the shared objects and the
    load stops at once, inside a 1 GiB address space; the trainer's command prints the one line."""
    path = tmp_path / "laughs.yaml"
    path.write_text(LAUGHS)
    load = "import sys; from jaxrl.config import apply_overrides, read_config_file; " \
           "apply_overrides(read_config_file(sys.argv[1]), [])"
    done = subprocess.run([sys.executable, "-c", load, str(path)], capture_output=True, text=True, timeout=120,
                          preexec_fn=_in_1_gib)
    assert done.stderr.strip().endswith(f"ConfigError: config file {str(path)!r}: its aliases expand to more than "
                                        f"{MAX_CONFIG_VALUES:,} values (a config needs hundreds); write the repeated "
                                        f"parts out or use fewer nested aliases"), done.stderr
    done = subprocess.run([sys.executable, "-m", "jaxrl.cli", "train", str(path)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert done.stderr.startswith(f"jaxrl train: config error: config file {str(path)!r}: its aliases expand")


def test_aliases_and_merge_keys_a_config_uses_still_load(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("output_dir: o\nmodel: {hf_path: m}\n"
                    "data: &data {tokenizer: t, train_files: [a.jsonl], max_prompt_tokens: 7}\n"
                    "sft:\n  stages:\n    - {steps: 1, data: {<<: *data, max_prompt_tokens: 9}}\n")
    assert read_config_file(path)["sft"]["stages"][0]["data"] == {"tokenizer": "t", "train_files": ["a.jsonl"],
                                                                 "max_prompt_tokens": 9}


@pytest.mark.parametrize("text, where", [
    ("a: &a [*a]\n", "an alias refers to the mapping or list that holds it"),
    ("output_dir: o\nsteps: 3\noptimizer:\n  lr: 0.1\nsteps: 4\n", "key 'steps' appears twice in one mapping (line 5)"),
    ("optimizer:\n  lr: 0.1\n  clip_norm: 1\n  lr: 0.2\n", "key 'lr' appears twice in one mapping (line 4)"),
])
def test_a_self_holding_alias_or_a_twice_given_key_is_refused(tmp_path, text, where):
    """Before: a key given twice kept the last value without a word (a typo'd second ``lr:`` won);
    a self-holding alias ended in a RecursionError traceback."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="^config file .*c.yaml'?: " + where.replace("(", r"\(").replace(")", r"\)")):
        read_config_file(path)


def test_a_twice_given_key_in_json_or_an_override_is_refused(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"output_dir": "a", "steps": 1, "steps": 2}')
    with pytest.raises(ConfigError, match="key 'steps' appears twice in one object"):
        read_config_file(path)
    with pytest.raises(ConfigError, match="^override optimizer: key 'lr' appears twice"):
        load_config(TrainConfig, None, ["optimizer={lr: 1, lr: 2}"])


@pytest.mark.parametrize("override, message", [
    ("seed=12345678901234567890123456789012345678",
     "seed: 12345678901234567890123456789012345678 is outside the 64-bit integer range [-2**63, 2**63 - 1]; "
     "give a smaller number"),
    ("seed=-1", "section <top> (TrainConfig): seed must be >= 0, got -1"),
    ("data.seed=4294967296", "section data (DataConfig): seed must be in [0, 2**32 - 1], got 4294967296"),
])
def test_integers_no_consumer_takes_are_refused_at_load(tmp_path, override, message):
    """Before: a 38-digit seed ended in an OverflowError traceback, a negative run seed in numpy's
    'expected non-negative integer', a data seed past 32 bits in grain's ValueError, each after the
    model was built."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"output_dir": str(tmp_path / "o"), "model": {"hf_path": "m"},
                                "data": {"tokenizer": "t", "train_files": ["a.jsonl"]}}))
    done = subprocess.run([sys.executable, "-m", "jaxrl.cli", "train", str(path), override], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip() == f"jaxrl train: config error: {message}", done.stderr
