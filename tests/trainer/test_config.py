"""Typed config loading: files, overrides, and errors that name the key and what is allowed."""

import dataclasses
import json
from typing import Literal

import pytest

from jaxrl.config import ConfigError, apply_overrides, from_dict, load_config, to_dict


@dataclasses.dataclass(frozen=True)
class Opt:
    lr: float = 1e-3
    schedule: Literal["cosine", "constant"] = "cosine"
    betas: tuple[float, float] = (0.9, 0.999)

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


@dataclasses.dataclass(frozen=True)
class Top:
    name: str
    steps: int = 10
    use_kl: bool = False
    files: tuple[str, ...] = ()
    eval_every: int | None = None
    optimizer: Opt = Opt()
    tasks: dict[str, Opt] = dataclasses.field(default_factory=dict)


def test_yaml_file_with_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: run\nsteps: 5\noptimizer:\n  lr: 3.0e-4\n  schedule: constant\nfiles: [a.jsonl]\n")
    cfg = load_config(Top, path, ["optimizer.lr=1e-4", "steps=7", "use_kl=true", "eval_every=null",
                                  "tasks.math.schedule=constant"])
    assert cfg == Top(name="run", steps=7, use_kl=True, files=("a.jsonl",),
                      optimizer=Opt(lr=1e-4, schedule="constant"), tasks={"math": Opt(schedule="constant")})
    # JSON files and a round trip through to_dict give the same config.
    json_path = tmp_path / "c.json"
    json_path.write_text(json.dumps(to_dict(cfg)))
    assert load_config(Top, json_path) == cfg


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["stepz=3"], r"unknown key stepz .*allowed keys: \['eval_every', 'files', 'name', 'optimizer', 'steps'"),
        (["optimizer.learning_rate=1"],
         r"unknown key optimizer.learning_rate .*allowed keys: \['betas', 'lr', 'schedule'\]"),
        (["steps=many"], r"steps: expected an integer, got 'many'"),
        (["steps=1.5"], r"steps: expected an integer, got 1.5"),
        (["use_kl=3"], r"use_kl: expected true or false, got 3"),
        (["optimizer.schedule=linear"],
         r"optimizer.schedule: 'linear' is not allowed; allowed values: \['cosine', 'constant'\]"),
        (["optimizer.betas=[0.9]"], r"optimizer.betas: expected 2 items"),
        (["optimizer.lr=-1"], r"section optimizer \(Opt\): lr must be > 0, got -1.0"),
        (["optimizer=3"], r"optimizer: expected a mapping for section Opt"),
        (["steps"], r"must look like section.key=value"),
        (["steps.x=1"], r"steps: expected an integer, got \{'x': 1\}"),
        (["files=[1]"], r"files\[0\]: expected a string, got 1"),
    ],
)
def test_errors_name_the_key_and_allowed_values(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Top, None, ["name=x", *overrides])


def test_missing_required_key_and_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="missing required key name"):
        from_dict(Top, {})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Top, tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(Top, bad)


def test_overrides_do_not_mutate_input():
    data = {"optimizer": {"lr": 1.0}}
    assert apply_overrides(data, ["optimizer.lr=2"]) == {"optimizer": {"lr": 2}}
    assert data == {"optimizer": {"lr": 1.0}}


def test_policy_remat_choices_are_the_models_remat_policies():
    """The trainer's ``model.remat`` Literal (what the YAML loader checks) is the model's registry plus "none"."""
    import typing

    from jaxrl.models.config import REMAT_POLICY_NAMES
    from jaxrl.trainer.config import PolicyConfig

    remat = typing.get_type_hints(PolicyConfig)["remat"]
    choices = next(typing.get_args(arg) for arg in typing.get_args(remat) if typing.get_origin(arg) is Literal)
    assert choices == ("none", *REMAT_POLICY_NAMES)


def test_policy_attention_impl_choices_are_the_models():
    """``model.attention_impl`` accepts exactly the model's attention implementations."""
    import typing

    from jaxrl.models.config import ATTENTION_IMPL_NAMES
    from jaxrl.trainer.config import PolicyConfig

    impl = typing.get_type_hints(PolicyConfig)["attention_impl"]
    choices = next(typing.get_args(arg) for arg in typing.get_args(impl) if typing.get_origin(arg) is Literal)
    assert choices == ATTENTION_IMPL_NAMES
