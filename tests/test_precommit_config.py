"""The optional pre-commit configuration runs the same checks as the test command, with the same ruff."""

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_precommit_runs_the_test_commands_ruff_checks():
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    entries = [hook["entry"] for repo in config["repos"] for hook in repo["hooks"]]
    test_sh = (ROOT / "scripts" / "test.sh").read_text()
    # the same two checks scripts/test.sh runs, through the same pinned binary (.venv/bin/ruff)
    assert any(e.startswith(".venv/bin/ruff check") for e in entries) and ".venv/bin/ruff check ." in test_sh
    assert any(e.startswith(".venv/bin/ruff format --check") for e in entries)
    assert ".venv/bin/ruff format --check ." in test_sh
