"""configs/README.md, the reproduction index, and the recipes cannot drift apart: every paper recipe has its
row, every row names a recipe that exists, runs it with its own task's CLI, and quotes the same paper number
as the recipe's header."""
from __future__ import annotations

import re

import pytest

from configs.tasks import is_recipe
from tests.recipes import REPO

INDEX = REPO / "configs" / "README.md"
RECIPE_CELL = re.compile(r"\[`?([\w.]+\.yaml)`?\]\((\w+)/[\w.]+\.yaml\)")


def index_rows() -> list[dict]:
    """One dict per table row that links a recipe: its cells by column name, plus task and recipe."""
    rows, header = [], None
    for line in INDEX.read_text(encoding="utf-8").splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if header is None:
            header = [cell.lower() for cell in cells]
            continue
        if set(line.replace("|", "").strip()) <= set("-: "):
            continue
        row = dict(zip(header, cells))
        found = RECIPE_CELL.search(row.get("recipe", ""))
        if found:
            row["recipe_file"], row["task"] = found.group(1), found.group(2)
            rows.append(row)
    return rows


def paper_recipes() -> set[str]:
    return {f"{p.parent.name}/{p.name}" for p in (REPO / "configs").glob("*/*.yaml") if not p.name.startswith("demo_") and is_recipe(p)}


def test_every_paper_recipe_has_one_row_and_every_row_an_existing_recipe():
    listed = [f"{row['task']}/{row['recipe_file']}" for row in index_rows()]
    assert sorted(set(listed)) == sorted(listed), "a recipe is listed twice"
    assert set(listed) == paper_recipes()


@pytest.mark.parametrize("row", index_rows(), ids=lambda row: row["recipe_file"])
def test_row_runs_its_recipe_and_quotes_the_recipes_number(row):
    recipe = REPO / "configs" / row["task"] / row["recipe_file"]
    assert f"python -m tasks.{row['task']} fit --config configs/{row['task']}/" \
           f"{row['recipe_file']}" in row["command"].replace("`", "")
    header = "\n".join(line for line in recipe.read_text().splitlines() if line.startswith("#"))
    number = row["paper number"].split()[0]
    if number not in ("-", "—"):
        assert number in header, f"{row['recipe_file']}: the index quotes {number}, its header does not"
