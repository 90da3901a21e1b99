"""A plain `pytest` collects every tier (pytest's defaults once hid tests/dist)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_tier_is_collected():
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for tier in ("unit", "dist", "gpu", "e2e"):
        assert f"tests/{tier}/" in out, f"no test collected from tests/{tier}"
