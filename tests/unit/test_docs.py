"""The README and the docs/ pages: the generated recipe page is the render of the field contracts
as they are now, every link of the README and every page of docs/ resolves, and the README keeps
the two set-up commands. Pure; milliseconds (`make lint` builds the pages with mkdocs --strict)."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import yaml

from hpctoolkit.config import fields as F
from hpctoolkit.recipe.schema import RecipeConfig

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def _generator():
    spec = importlib.util.spec_from_file_location("gen_recipes", DOCS / "gen_recipes.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_recipe_page_is_the_render_of_the_field_contracts():
    page = (DOCS / "recipes.md").read_text()
    assert page == _generator().render(), (
        "docs/recipes.md is stale: run `PYTHONPATH=$PWD .venv/bin/python docs/gen_recipes.py` and commit it"
    )


def test_the_recipe_page_names_every_field():
    page = (DOCS / "recipes.md").read_text()
    kinds = F.kinds_of(RecipeConfig)
    for f in dataclasses.fields(RecipeConfig):
        if isinstance(kinds[f.name], F.Nested):
            section = getattr(RecipeConfig(), f.name)
            for g in dataclasses.fields(section):
                assert f"| `{f.name}.{g.name}` |" in page
        else:
            assert f"| `{f.name}` |" in page


def test_the_render_describes_each_kind_and_follows_a_new_field():
    gen = _generator()
    assert gen.accepts(F.Int(1, 64)) == "integer 1..64"
    assert gen.accepts(F.Seconds(zero=True)) == "seconds >= 0"
    assert gen.accepts(F.Float(0.0, 1.0, lo_open=True)) == "number in (0, 1]"
    assert gen.accepts(F.Port(zero=True, optional=True)) == "port 0..65535 (0: pick a free one), or null"
    assert gen.accepts(F.ListOf(F.Choice(("a", "b")))) == "list of: one of `a`, `b`"

    @dataclasses.dataclass
    class Extra:
        # What the new field does.
        new_field: int = 3

        KINDS = {"new_field": F.Int(0, 9)}  # noqa: RUF012 -- a section as the configs declare one

    out: list[str] = []
    gen._section(Extra, "extra.", "`extra`", out)
    assert "| `extra.new_field` | integer 0..9 | `3` | What the new field does. |" in out


def test_the_readme_keeps_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## On a fresh machine", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    assert [c for c in commands if c] == ["make run", "make test"]
    assert len(readme.splitlines()) <= 200


def test_every_readme_link_resolves():
    readme = (ROOT / "README.md").read_text()
    targets = [m.group(1) for m in LINK.finditer(readme) if "://" not in m.group(1)]
    assert targets
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_every_page_is_in_the_site_and_every_entry_is_a_page():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = {next(iter(entry.values())) for entry in config["nav"]}
    pages = {p.name for p in DOCS.glob("*.md")}
    assert listed == pages
