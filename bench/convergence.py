"""Convergence of FP8 training: delayed and current scaling (per tensor), MXFP8 and FP8 block scaling
against the bf16 and fp32 baselines.

The tiny GPT trains on the default corpus (the standard library source, byte-level) with the same seed,
data order, initial weights and learning-rate schedule under each recipe, through the ``fp8-train`` loop
itself (in-process); every FP8 recipe with fp8-train's default format, HYBRID (E4M3 forward, E5M2
gradients), the block recipes with Transformer Engine's block parameters (MXFP8: 1x32 blocks, E8M0 scales;
block: 1x128 activations and gradients, 128x128 weights, power-of-two float32 scales). Validation loss is
measured on the same fixed batches every ``--eval-interval`` steps. The table shows each recipe's final
validation loss and its gap to fp32 and bf16; the goal is FP8 within 2% of each baseline run. On the CPU the
block recipes are emulated (fp8_trainer.block_linear) and several times slower per step than the per-tensor
ones; ``--recipes`` and ``--steps`` bound a run. The JSON (curves included) goes to
bench/results/convergence.json and the plot, a self-contained HTML file (plotly.js embedded, no CDN), to
bench/results/convergence.html. The ms/step column is for information only (the runs are sequential, not
interleaved: it is no speed comparison).

    python bench/convergence.py [--steps 300] [--batch-size 16] [--seq-len 64] [--recipes mxfp8,block,bf16]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from fp8_trainer.app import cli
from fp8_trainer.app.train import train

FP8 = ("delayed", "current", "mxfp8", "block")
RECIPES = (*FP8, "bf16", "fp32")
GOAL = 0.02  # relative gap of the final validation loss
RESULTS = Path(__file__).parent / "results"


def run_recipe(recipe: str, a: argparse.Namespace) -> dict:
    """Train under one recipe; return its validation curve, training losses and timing."""
    flags = ["--recipe", recipe, "--preset", "tiny", "--steps", str(a.steps), "--seed", str(a.seed)]
    flags += ["--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--lr", str(a.lr)]
    flags += ["--eval-interval", str(a.eval_interval), "--eval-iters", str(a.eval_iters), "--no-progress"]
    args, prepared = cli.prepare(flags)
    t0 = time.perf_counter()
    result = train(args, prepared, out=lambda line: None)
    seconds = time.perf_counter() - t0
    return {
        "flags": flags,
        "val_steps": [s for s, _ in result.val_losses],
        "val_loss": [v for _, v in result.val_losses],
        "train_loss": result.losses,
        "final_val_loss": result.val_losses[-1][1],
        "seconds": seconds,
        "ms_per_step": seconds / a.steps * 1e3,
    }


def gaps(runs: dict[str, dict]) -> None:
    """Add each recipe's relative gap of the final validation loss to each baseline present."""
    for run in runs.values():
        for base in ("fp32", "bf16"):
            if base in runs:
                ref = runs[base]["final_val_loss"]
                run[f"gap_vs_{base}"] = (run["final_val_loss"] - ref) / ref


def table(runs: dict[str, dict]) -> str:
    lines = [
        f"{'recipe':<8} {'final val loss':>14} {'vs fp32':>8} {'vs bf16':>8} {'ms/step':>8}  goal |gap| <= 2%"
    ]
    for name, run in runs.items():
        cells = []
        for base in ("fp32", "bf16"):
            gap = run.get(f"gap_vs_{base}")
            cells.append(f"{gap:+8.2%}" if gap is not None else f"{'n/a':>8}")
        fp8 = name in FP8
        verdict = ""
        if fp8:
            checked = [abs(run[k]) <= GOAL for k in ("gap_vs_fp32", "gap_vs_bf16") if k in run]
            verdict = "met" if checked and all(checked) else "MISSED" if checked else ""
        loss, ms = run["final_val_loss"], run["ms_per_step"]
        lines.append(f"{name:<8} {loss:14.4f} {cells[0]} {cells[1]} {ms:8.0f}  {verdict}")
    return "\n".join(lines)


def plot(runs: dict[str, dict], path: Path, title: str) -> None:
    """Validation (markers) and training (thin, smoothed) loss curves as one self-contained HTML file."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for name, run in runs.items():
        fig.add_trace(
            go.Scatter(x=run["val_steps"], y=run["val_loss"], mode="lines+markers", name=f"{name} val")
        )
        losses, k = run["train_loss"], 10
        smooth = [
            sum(losses[max(0, i - k + 1) : i + 1]) / len(losses[max(0, i - k + 1) : i + 1])
            for i in range(len(losses))
        ]
        fig.add_trace(
            go.Scatter(
                x=list(range(1, len(losses) + 1)),
                y=smooth,
                mode="lines",
                line={"width": 1},
                opacity=0.5,
                name=f"{name} train (mean of {k})",
                visible="legendonly",
            )
        )
    fig.update_layout(title=title, xaxis_title="optimizer step", yaxis_title="loss (nats per byte)")
    fig.write_html(path, include_plotlyjs=True, full_html=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-interval", type=int, default=25)
    p.add_argument("--eval-iters", type=int, default=16)
    p.add_argument(
        "--recipes", default=",".join(RECIPES), help="comma-separated subset of " + ",".join(RECIPES)
    )
    p.add_argument("--out", default=str(RESULTS / "convergence.json"))
    p.add_argument("--html", default=str(RESULTS / "convergence.html"))
    a = p.parse_args(argv)
    recipes = a.recipes.split(",")
    unknown = set(recipes) - set(RECIPES)
    if unknown:
        p.error(f"--recipes: unknown {sorted(unknown)}; expected a subset of {RECIPES}")

    print(
        f"tiny GPT, default corpus, {a.steps} steps x {a.batch_size} x {a.seq_len} tokens, lr {a.lr}, "
        f"seed {a.seed}, {torch.get_num_threads()} threads",
        flush=True,
    )
    runs = {}
    for recipe in recipes:
        runs[recipe] = run_recipe(recipe, a)
        print(f"  {recipe}: final val loss {runs[recipe]['final_val_loss']:.4f}", flush=True)
    gaps(runs)
    print(table(runs))

    out, html = Path(a.out), Path(a.html)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "preset": "tiny",
        "corpus": "stdlib (byte-level)",
        **{
            k: getattr(a, k)
            for k in ("steps", "batch_size", "seq_len", "lr", "seed", "eval_interval", "eval_iters")
        },
        "goal_abs_gap": GOAL,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    out.write_text(json.dumps({"meta": meta, "runs": runs}, indent=2))
    html.parent.mkdir(parents=True, exist_ok=True)
    plot(runs, html, f"FP8 convergence: tiny GPT, {a.steps} steps (validation loss on fixed batches)")
    print(f"wrote {out} and {html}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
