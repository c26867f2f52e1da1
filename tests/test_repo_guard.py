"""The session check that the suite writes nothing into the repository (tests/repo_guard.py)."""

import repo_guard


def test_a_run_folder_left_behind_is_named_and_caches_are_not(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "demo.yaml").write_text("steps: 1\n")
    (tmp_path / "README.md").write_text("# x\n")
    before = repo_guard.snapshot(str(tmp_path))

    (tmp_path / "runs" / "demo" / "rl" / "checkpoints").mkdir(parents=True)  # empty, still in the way
    (tmp_path / "runs" / "demo" / "rl" / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "configs" / "demo.yaml").write_text("steps: 2\n")
    (tmp_path / "README.md").unlink()
    for cache in ("__pycache__", ".pytest_cache", ".venv-sglang", "jaxrl.egg-info"):
        (tmp_path / cache).mkdir()
        (tmp_path / cache / "x").write_text("x")

    found = repo_guard.changes(before, repo_guard.snapshot(str(tmp_path)))
    assert found == [
        "removed  README.md",
        "changed  configs/demo.yaml",
        "added    runs/",
        "added    runs/demo/",
        "added    runs/demo/rl/",
        "added    runs/demo/rl/checkpoints/",
        "added    runs/demo/rl/metrics.jsonl",
    ]
    assert "runs/demo/rl/checkpoints" in repo_guard.report(found)


def test_an_untouched_tree_has_no_changes(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "b.txt").write_text("b")
    assert repo_guard.changes(repo_guard.snapshot(str(tmp_path)), repo_guard.snapshot(str(tmp_path))) == []
