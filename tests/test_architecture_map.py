"""docs/ARCHITECTURE.md's floors are the layering test's: the design document names each floor
of the import order (bottom last), in the order tests/test_layering.py enforces, and each
folder it names exists. The document explains floors, not every module: a module that moves
inside its floor changes nothing here."""

from __future__ import annotations

import re
from pathlib import Path

from tests.test_layering import FLOORS

ROOT = Path(__file__).resolve().parent.parent


def _floors_block() -> str:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text[text.index("## Floors") :]
    return section.split("```")[1]


def _named_floors() -> list[str]:
    return re.findall(r"^([a-z_]+(?:/[a-z_]+)*)/", _floors_block(), flags=re.M)


def test_the_design_names_the_floors_the_layering_test_enforces_top_down() -> None:
    assert _named_floors() == list(reversed(FLOORS))


def test_every_floor_the_design_names_exists() -> None:
    assert [f for f in _named_floors() if not (ROOT / f).is_dir()] == []
