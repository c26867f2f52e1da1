"""The suite writes nothing into the repository: a session check (tests/conftest.py).

A test that runs a shipped config with its own ``output_dir`` (``runs/...``) or
``checkpoint.directory`` collides with the run a user's ``bash scripts/demo.sh`` left there
(``RunExistsError``) and leaves files behind. The controller process snapshots every file of the
working tree before the session and again after it; anything added, changed or removed fails
the run, naming the paths. Caches and virtual environments are not the suite's output.
"""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Folders a test run may write: interpreter and tool caches, the venvs the setup scripts build.
_SKIPPED = {".git", "__pycache__", ".pytest_cache", ".ruff_cache"}


def _skipped(name: str) -> bool:
    return name in _SKIPPED or name.startswith(".venv") or name.endswith(".egg-info")


def snapshot(root: str = ROOT) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` (relative path) with its size and modification time, and every folder
    (an empty one too: a checkpoint folder made and left empty is still in the way; its times change
    with its contents, so only whether it exists counts), caches and venvs left out."""
    files = {}
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if not _skipped(name)]
        files.update({os.path.relpath(os.path.join(folder, name), root) + os.sep: (-1, -1) for name in subfolders})
        for name in names:
            path = os.path.join(folder, name)
            try:
                stat = os.lstat(path)
            except FileNotFoundError:  # removed while walking
                continue
            files[os.path.relpath(path, root)] = (stat.st_size, stat.st_mtime_ns)
    return files


def changes(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> list[str]:
    """Lines naming each path added, changed or removed between two snapshots, sorted."""
    lines = [f"added    {path}" for path in after.keys() - before.keys()]
    lines += [f"removed  {path}" for path in before.keys() - after.keys()]
    lines += [f"changed  {path}" for path in before.keys() & after.keys() if before[path] != after[path]]
    return sorted(lines, key=lambda line: line[9:])


def report(found: list[str], limit: int = 20) -> str:
    """The message that fails the session."""
    more = f"\n  ... and {len(found) - limit} more" if len(found) > limit else ""
    return ("the test suite wrote into the repository (a test must put output_dir, checkpoint.directory "
            "and every other output under its tmp_path):\n  " + "\n  ".join(found[:limit]) + more)
