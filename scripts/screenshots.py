"""Screenshots of the dashboard for the docs: four real (tiny) FP8 trainings streamed into a fresh monitor,
then the run page, the runs list with tags and config columns, and the four runs compared.

    .venv/bin/python scripts/screenshots.py            # writes docs/screenshots/*.png (about 2 minutes)

Needs Chromium at /usr/bin/chromium (Debian's package) and Playwright for Python (the dev extra).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.server import API, ServerProcess  # noqa: E402
from tests.web.browser import CHROMIUM, CHROMIUM_ARGS, VIEWPORT, wait_drawn  # noqa: E402

RUNS = [  # (name, learning rate, recipe, tags, extra flags)
    ("tiny-delayed-lr1e-3", "1e-3", "delayed", ["sweep-lr", "delayed"], []),
    ("tiny-delayed-lr3e-3", "3e-3", "delayed", ["sweep-lr", "delayed"], []),
    ("tiny-current-lr1e-3", "1e-3", "current", ["sweep-lr", "current"], []),
    ("tiny-delayed-nan", "1e-3", "delayed", ["fault"], ["--inject", "nan:blocks.1.mlp.fc@40"]),
]


def train(url: str, name: str, lr: str, recipe: str, tags: list[str], extra: list[str], steps: int) -> None:
    cmd = [
        sys.executable,
        "-m",
        "fp8_trainer.app.cli",
        "--preset",
        "tiny",
        "--steps",
        str(steps),
        "--batch-size",
        "8",
        "--seq-len",
        "64",
        "--lr",
        lr,
        "--recipe",
        recipe,
        "--eval-interval",
        "20",
        "--no-progress",
        "--monitor-url",
        url,
        "--run-name",
        name,
        *[a for t in tags for a in ("--tag", t)],
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as cwd:
        subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, env=env, timeout=1800)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    p.add_argument("--steps", type=int, default=80)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="fp8scope-screenshots-"))
    server = ServerProcess(f"sqlite:///{work / 'monitor.db'}", log_path=work / "server.log").start()
    try:
        for name, lr, recipe, tags, extra in RUNS:
            train(server.url, name, lr, recipe, tags, extra, args.steps)
            print(f"trained {name}", file=sys.stderr)
        runs = {r["name"]: r for r in httpx.get(f"{server.url}{API}/runs").json()}
        from playwright.sync_api import sync_playwright

        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_context(viewport={**VIEWPORT, "width": 1440}).new_page()
            page.add_init_script("localStorage.setItem('fp8scope.runColumns', 'lr,recipe,amax_history_len')")
            page.goto(f"{server.url}/#/")
            page.wait_for_selector("#runs-table tbody tr td.config-value")
            page.screenshot(path=str(args.out / "runs-list.png"), full_page=True)
            faulty = runs["tiny-delayed-nan"]["id"]
            page.goto(f"{server.url}/#/runs/{faulty}")
            wait_drawn(page, "heatmap", "curves")
            page.wait_for_selector("#scalars-plot .main-svg")
            page.wait_for_selector("#incidents-list li.incident")
            page.screenshot(path=str(args.out / "run-page.png"), full_page=True)
            ids = ",".join(str(runs[name]["id"]) for name, *_ in RUNS)
            page.goto(f"{server.url}/#/compare?runs={ids}")
            page.wait_for_function("() => window.fp8scope.drawn.compare !== undefined")
            page.screenshot(path=str(args.out / "compare-4-runs.png"), full_page=True)
            browser.close()
    finally:
        server.stop()
    for png in sorted(args.out.glob("*.png")):
        print(png.relative_to(ROOT))


if __name__ == "__main__":
    main()
