"""The repository stands on its own: every ``docs/<page>.md#<section>`` the code cites exists, the
README's and docs' relative links resolve, and nothing points at a path outside the repository."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SOURCES = [p for folder in ("jaxrl", "tests", "bench", "configs", "launch", "scripts")
           for p in sorted((ROOT / folder).rglob("*")) if p.suffix in (".py", ".yaml", ".sh", ".toml")]
CITATION = re.compile(r"docs/([\w-]+\.md)(?:#([\w-]+))?")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _without_code_blocks(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


def _anchors(page: pathlib.Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes, repeats numbered."""
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", _without_code_blocks(page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-")
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


ANCHORS = {page.name: _anchors(page) for page in PAGES if page.parent.name == "docs"}


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_citations_resolve(path):
    if path == pathlib.Path(__file__):
        return
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        for page, anchor in CITATION.findall(line):
            where = f"{path.relative_to(ROOT)}:{number}"
            assert page in ANCHORS, f"{where} cites docs/{page}, which does not exist"
            assert not anchor or anchor in ANCHORS[page], f"{where} cites docs/{page}#{anchor}: no such section"
        assert "SPEC" not in re.sub(r"[A-Z_]*SPECS?[A-Z_]+|[A-Z_]+SPECS?\b", "", line), (
            f"{path.relative_to(ROOT)}:{number} cites the spec, which is not in the repository; cite docs/ instead")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_link_inside_the_repository(page):
    text = page.read_text()
    assert not re.search(r"\.\./shared|shared/|/work/", text), f"{page.name} points outside the repository"
    for target in LINK.findall(re.sub(r"`[^`\n]*`", "", _without_code_blocks(text))):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        assert dest.is_relative_to(ROOT) and dest.exists(), f"{page.name} links {target}, which does not exist"
        if anchor and dest.suffix == ".md":
            assert anchor in _anchors(dest), f"{page.name} links {target}: no such section in {dest.name}"


def test_code_points_at_nothing_outside_the_repository():
    outside = re.compile(r"\.\./" + "shared|/work/" + "shared")  # split so this file does not match itself
    for path in SOURCES:
        assert not outside.search(path.read_text(errors="replace")), (
            f"{path.relative_to(ROOT)} points outside the repository")


def _config_keys(cls, prefix: str = ""):
    """Every dotted key of a config dataclass, nested sections included (a model's architecture is a
    transformers config.json's fields, documented by transformers)."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name.startswith("_"):
            continue
        kind = hints[field.name]
        sections = [kind] if dataclasses.is_dataclass(kind) else [
            a for a in (*typing.get_args(kind), *(b for a in typing.get_args(kind) for b in typing.get_args(a)))
            if dataclasses.is_dataclass(a)]
        yield prefix + field.name
        if sections and field.name != "architecture":
            yield from _config_keys(sections[0], f"{prefix}{field.name}.")


def test_every_config_key_is_named_in_the_docs():
    """A user reading a config finds each key in docs/ (training.md's sections, or the page of its
    subsystem): in backticks, whole or by a trailing part (`push.group_port`, `group_port`), or as a
    YAML key."""
    from jaxrl.trainer.config import TrainConfig

    docs = "".join(page.read_text() for page in sorted((ROOT / "docs").rglob("*.md")))
    keys = list(_config_keys(TrainConfig))

    def named(key: str) -> bool:
        parts = key.split(".")
        tails = [".".join(parts[i:]) for i in range(len(parts))]
        return any(f"`{tail}`" in docs for tail in tails) or f"{parts[-1]}:" in docs

    missing = [key for key in keys if not named(key)]
    assert len(keys) > 250 and not missing, missing
