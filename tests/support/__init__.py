"""What tests of more than one area share: the monitor service's wire factories and processes
(`tests.support.server`), polling (`tests.support.polling`), the GPU skip mark (`tests.support.gpu`) and the
repository root. A helper that one area alone uses lives in that area's folder."""

from pathlib import Path

#: the repository root (README.md, bench/, the packages)
ROOT = Path(__file__).resolve().parents[2]
