"""``fp8-train``: train the small GPT on the standard-library corpus in FP8 and print its FP8 health."""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from .autocast import fp8_autocast
from .convert import convert_to_fp8, tensor_table
from .data import ByteCorpus
from .model import GPT, PRESETS, fp8_filter
from .recipe import AMAX_COMPUTE_ALGOS, CurrentScaling, DelayedScaling, Format
from .stats import StatsReader

__all__ = ["health_table", "main"]

DELAYED_ONLY = ("margin", "amax_history_len", "amax_compute_algo", "interval")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fp8-train", description=__doc__)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--recipe", choices=("delayed", "current", "fp32", "bf16"), default="delayed")
    p.add_argument("--fp8-format", choices=("hybrid", "e4m3"), default=None, help="default: hybrid")
    p.add_argument("--margin", type=int, default=None, help="delayed scaling margin (default 0)")
    p.add_argument("--amax-history-len", type=int, default=None, help="default 16")
    p.add_argument("--amax-compute-algo", choices=AMAX_COMPUTE_ALGOS, default=None, help="default max")
    p.add_argument("--interval", type=int, default=None, help="default 1")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--eval-interval", type=int, default=100, help="steps between validation losses (0: never)"
    )
    p.add_argument("--log-interval", type=int, default=20)
    return p


def _check(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    for name in ("steps", "batch_size", "seq_len", "grad_accum", "log_interval"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.eval_interval < 0:
        p.error("--eval-interval must be >= 0")
    if a.seq_len > PRESETS[a.preset].block_size:
        p.error(
            f"--seq-len {a.seq_len} exceeds preset {a.preset}'s block size {PRESETS[a.preset].block_size}"
        )
    fp8 = a.recipe in ("delayed", "current")
    if not fp8 and a.fp8_format is not None:
        p.error(f"--fp8-format needs an FP8 recipe (delayed or current), not --recipe {a.recipe}")
    given = [n for n in DELAYED_ONLY if getattr(a, n) is not None]
    if given and a.recipe != "delayed":
        p.error(f"--{given[0].replace('_', '-')} applies to --recipe delayed only")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device available")
    try:
        make_recipe(a)
    except ValueError as e:
        p.error(str(e))
    if a.preset != "tiny" and a.device == "cpu":
        print(f"note: preset {a.preset} on the CPU will be very slow", file=sys.stderr)


def make_recipe(a: argparse.Namespace):
    """The FP8 recipe the flags describe (``None`` for fp32 / bf16)."""
    fmt = Format.parse(a.fp8_format or "hybrid")
    if a.recipe == "delayed":
        return DelayedScaling(
            fp8_format=fmt,
            margin=a.margin if a.margin is not None else 0,
            amax_history_len=a.amax_history_len if a.amax_history_len is not None else 16,
            amax_compute_algo=a.amax_compute_algo or "max",
            interval=a.interval if a.interval is not None else 1,
        )
    if a.recipe == "current":
        return CurrentScaling(fp8_format=fmt)
    return None


def health_table(model, stats: torch.Tensor) -> str:
    """Per-layer FP8 health: amax and scale per role, counts summed over roles, worst tensor flagged."""
    table = tensor_table(model)
    s = stats.to("cpu", torch.float64)
    lines = [
        f"{'layer':<22} {'in amax':>9} {'in scale':>9} {'w amax':>9} {'w scale':>9} {'go amax':>9} "
        f"{'go scale':>9} {'overflow':>9} {'underflow':>9} {'nonfinite':>9}"
    ]
    worst, worst_key = None, (0.0, 0.0, 0.0)
    for i in range(0, len(table), 3):
        rows = s[i : i + 3]
        cells = " ".join(f"{rows[r, 0]:9.3g} {rows[r, 1]:9.3g}" for r in range(3))
        ovf, unf, nf = (int(rows[:, c].sum()) for c in (2, 3, 4))
        lines.append(f"{table[i].layer:<22} {cells} {ovf:9d} {unf:9d} {nf:9d}")
        for r in range(3):
            numel = max(float(rows[r, 5]), 1.0)
            key = (float(rows[r, 4]), float(rows[r, 2]) / numel, float(rows[r, 3]) / numel)
            if key > worst_key:
                worst, worst_key = table[i + r].name, key
    if worst is None:
        lines.append("all tensors healthy: no overflow, underflow or non-finite values")
    else:
        nf, ovf, unf = worst_key
        lines.append(f"worst: {worst} (nonfinite {int(nf)}, overflow {ovf:.2%}, underflow {unf:.2%})")
    return "\n".join(lines)


@torch.no_grad()
def _evaluate(model, corpus, a, recipe, iters: int = 4) -> float:
    model.eval()
    losses = []
    for _ in range(iters):
        x, y = (t.to(a.device) for t in corpus.batch("val", a.batch_size, a.seq_len))
        with fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe), _bf16(a):
            losses.append(model(x, y)[1].float())
    model.train()
    return torch.stack(losses).mean().item()


def _bf16(a):
    return torch.autocast(a.device, dtype=torch.bfloat16, enabled=a.recipe == "bf16")


def train(a: argparse.Namespace, out=print) -> list[float]:
    """Run the training loop the flags describe; return the per-step training losses."""
    torch.manual_seed(a.seed)
    recipe = make_recipe(a)
    corpus = ByteCorpus(seed=a.seed)
    model = GPT(PRESETS[a.preset]).to(a.device)
    if recipe is not None:
        convert_to_fp8(model, recipe=recipe, module_filter_fn=fp8_filter)
        reader = StatsReader(model)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    out(
        f"fp8-train: preset {a.preset}, recipe {a.recipe}"
        + (f" {recipe.to_dict()}" if recipe is not None else "")
        + f", {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, device {a.device}"
    )
    losses, t0 = [], time.perf_counter()
    for step in range(1, a.steps + 1):
        step_loss = torch.zeros((), device=a.device)
        for micro in range(a.grad_accum):
            x, y = (t.to(a.device) for t in corpus.batch("train", a.batch_size, a.seq_len))
            last = micro == a.grad_accum - 1
            with fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe, step_boundary=last), _bf16(a):
                _, loss = model(x, y)
            (loss / a.grad_accum).backward()
            step_loss += loss.detach() / a.grad_accum
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(step_loss)
        if recipe is not None:
            reader.poll()  # starts the async copy; a monitor would consume the previous step here
        if step % a.log_interval == 0 or step == a.steps:
            loss_v = losses[-1].item()
            dt = (time.perf_counter() - t0) / step
            out(f"step {step:5d}  loss {loss_v:.4f}  {dt * 1e3:.0f} ms/step")
            if recipe is not None and step != a.steps:
                got = reader.read_now()
                if got is not None:
                    s = got[1]
                    out(
                        f"           fp8: max amax {s[:, 0].max():.3g}, overflow {int(s[:, 2].sum())}, "
                        f"underflow {int(s[:, 3].sum())}, nonfinite {int(s[:, 4].sum())}"
                    )
        if a.eval_interval and (step % a.eval_interval == 0 or step == a.steps):
            out(f"step {step:5d}  val loss {_evaluate(model, corpus, a, recipe):.4f}")
    if recipe is not None:
        got = reader.read_now()
        if got is not None:
            out(f"FP8 health after step {got[0]} (per layer; counts summed over input, weight, grad_output):")
            out(health_table(model, got[1]))
    result = [v.item() for v in losses]
    if not all(math.isfinite(v) for v in result):
        out("warning: non-finite training loss")
    return result


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fp8-train`` console script."""
    p = build_parser()
    a = p.parse_args(argv)
    _check(p, a)
    train(a, out=lambda s: print(s, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
