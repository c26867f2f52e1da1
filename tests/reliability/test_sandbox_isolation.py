"""``env.tasks.<task>.python.isolation`` through ``jaxrl train`` (docs/agentic.md#the-python-sandbox).

Before: the key was ``network`` and only chose whether a network namespace was required; a run
never said that model code would run as the trainer's user. Now ``required`` refuses to start on
a machine without the jail (exit 2, one line naming the key and what is missing), ``auto`` starts
with one warning naming what is missing, and both start normally where the jail works.
"""

import logging

import pytest
import yaml

from jaxrl.sandbox import probe
from jaxrl.trainer.cli import train_main


def _tools_run(run_config, tmp_path, isolation: str) -> str:
    config = run_config(tmp_path / "out", steps=1, env={
        "task_field": "none", "default_task": "tools",
        "tasks": {"tools": {"kind": "tools", "tools": ["python"], "python": {"isolation": isolation},
                            "limits": {"max_turns": 2, "max_total_tokens": 24, "max_observation_tokens": 4}}}})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_required_refuses_to_start_without_the_jail(run_config, tmp_path, no_bubblewrap, capsys):
    assert train_main([_tools_run(run_config, tmp_path, "required")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "env.tasks.tools.python has isolation: required" in err[0] and "bubblewrap" in err[0]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_auto_starts_without_the_jail_and_says_what_is_missing(run_config, tmp_path, no_bubblewrap, caplog):
    with caplog.at_level(logging.WARNING, logger="jaxrl.sandbox"):
        assert train_main([_tools_run(run_config, tmp_path, "auto")]) == 0
    warnings = sorted(r.getMessage() for r in caplog.records if r.name.startswith("jaxrl.sandbox"))
    assert len(warnings) == 2, warnings  # once each: the python tool, and the reward worker's containment
    assert warnings[0].startswith("env.tasks.tools.python runs model code in a plain process")
    assert warnings[1].startswith("the reward worker runs without a PID namespace of its own")
    assert all("bubblewrap" in w for w in warnings)


@pytest.mark.skipif(probe().jail is None or probe().missing, reason=f"no whole jail here: {probe().describe()}")
@pytest.mark.parametrize("isolation", ["required", "auto"])
def test_with_the_jail_both_start_without_a_warning(run_config, tmp_path, isolation, caplog):
    with caplog.at_level(logging.WARNING, logger="jaxrl.sandbox"):
        assert train_main([_tools_run(run_config, tmp_path, isolation)]) == 0
    assert not [r for r in caplog.records if r.name.startswith("jaxrl.sandbox")]
