"""What several benchmarks share: writing their results, the record of the machine their numbers belong to,
and the tiny-GPT training job (with its command-line options) that the step-overhead benchmarks time in
interleaved modes.

Importing this module costs nothing heavy: torch and the trainer are imported by the helpers that need
them, so the HTTP benchmarks that only write results do not load them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]


def write_json(path: Path, data: object, indent: int = 2) -> None:
    """`data` as JSON at `path`, its folder made first (a fresh checkout has no bench/results)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent))


def shown_path(path: Path) -> Path:
    """`path` as a message shows it: relative to the repository where it lies inside it."""
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def machine_info() -> dict[str, Any]:
    """The machine an HTTP benchmark's numbers belong to: its CPUs, Python and platform."""
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}


def doc_parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser whose ``--help`` shows the script's docstring `doc` as it is written."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def torch_meta() -> dict[str, str]:
    """The versions and the machine a torch benchmark's numbers belong to."""
    import torch

    return {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine()}


@dataclass(frozen=True)
class Column:
    """A column of a printed table: its `heading`, the `value` of a row it shows (the row's key, or a function
    of the row), its `width` and its format spec (`fmt`, e.g. ``".1f"``; text when empty). Text is aligned
    left and numbers right unless `align` says otherwise."""

    heading: str
    value: str | Callable[[dict], object]
    width: int
    fmt: str = ""
    align: str = ""

    def cell(self, row: dict) -> str:
        value = self.value(row) if callable(self.value) else row[self.value]
        return format(value, f"{self._align}{self.width}{self.fmt}")

    def head(self) -> str:
        return format(self.heading, f"{self._align}{self.width}")

    @property
    def _align(self) -> str:
        return self.align or (">" if self.fmt else "<")


def table(rows: Iterable[dict], columns: Sequence[Column], note: str = "") -> list[str]:
    """The lines of a table of `rows`: the headings (with `note` after them), then a line per row."""
    head = " ".join(c.head() for c in columns) + (f"  {note}" if note else "")
    return [head] + [" ".join(c.cell(r) for c in columns) for r in rows]


def write_report(path: Path, heading: str, lines: list[str], rows: list[dict], meta: dict[str, Any]) -> int:
    """Print `heading` and the table `lines` (the summary), and write the results layout of the benchmarks
    that print a table (the one scripts/gpu-check.sh summarises): `meta` with `torch_meta()` after it, the
    rows and the summary; says where it went. Returns 0, the script's exit status."""
    summary = "\n".join(lines)
    print(heading)
    print(summary)
    write_json(path, {"meta": meta | torch_meta(), "rows": rows, "summary": summary})
    print(f"wrote {path}")
    return 0


#: the options of the per-layer host benchmarks (`layer_parser`), recorded in their results' meta
LAYER_OPTIONS = ("smoke", "layers", "tokens", "features", "steps", "rounds")


def layer_parser(
    doc: str,
    results: str,
    *,
    layers: int,
    tokens: int,
    features: int,
    steps: int,
    rounds: int,
    layers_help: str | None = None,
) -> argparse.ArgumentParser:
    """The options of a benchmark that times a stack of Linear layers on the host (the first paragraph of
    `doc` is its description; `--out` defaults to bench/results/`results`)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=layers, help=layers_help)
    ap.add_argument("--tokens", type=int, default=tokens)
    ap.add_argument("--features", type=int, default=features)
    ap.add_argument("--steps", type=int, default=steps, help="steps per timed block")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / results)
    ap.add_argument("--smoke", action="store_true", help="a few steps (exercises the script only)")
    return ap


def layer_meta(args: argparse.Namespace) -> dict[str, Any]:
    """The `LAYER_OPTIONS` a run of a per-layer host benchmark used, for its results' meta."""
    return {k: vars(args)[k] for k in LAYER_OPTIONS}


@dataclass(frozen=True)
class Cases:
    """The cases of a seeded benchmark (its faults or scenarios): `what` one is called, all it `known`s,
    those it runs by default (`default`, all when None) and in its small mode (`small`, `default`'s when
    None)."""

    what: str
    known: tuple[str, ...]
    default: tuple[str, ...] | None = None
    small: tuple[str, ...] | None = None

    def chosen(self, small: bool) -> tuple[str, ...]:
        default = self.default or self.known
        return (self.small or default) if small else default


def seeded_parser(doc: str, results: str, small: tuple[str, str], cases: Cases) -> argparse.ArgumentParser:
    """The options of a benchmark of seeded training runs per case: its small mode (`small`: the flag and
    what it does; ``args.small``), the seeds per case (`--seeds`), some cases only (`--only`) and `--out`
    (bench/results/`results` by default); the first line of `doc` is its description. Read the command line
    with `seeded_args`."""
    flag, small_help = small
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument(flag, dest="small", action="store_true", help=small_help)
    p.add_argument("--seeds", type=int, default=None, help=f"seeds per {cases.what} (default 3; {flag}: 1)")
    default, in_small = (
        ",".join(c) if c != cases.known else "all" for c in (cases.chosen(False), cases.chosen(True))
    )
    p.add_argument("--only", help=f"comma-separated {cases.what}s (default {default}; {flag}: {in_small})")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / results)
    return p


def seeded_args(
    parser: argparse.ArgumentParser, cases: Cases
) -> tuple[argparse.Namespace, list[int], list[str]]:
    """The command line of a `seeded_parser`: the options, the seeds each case runs with (`--seeds` of
    them, by default 3, 1 in the small mode) and the cases `--only` names (comma-separated; default
    `cases.chosen`). A case not in `cases.known` ends the run with a usage error that lists them."""
    args = parser.parse_args()
    seeds = list(range(args.seeds or (1 if args.small else 3)))
    chosen = args.only.split(",") if args.only else list(cases.chosen(args.small))
    unknown = [c for c in chosen if c not in cases.known]
    if unknown:
        parser.error(f"--only: unknown {cases.what}s {unknown}; choose from {list(cases.known)}")
    return args, seeds, chosen


def print_load_average() -> None:
    """The load average at the end of a run: on a shared machine, how far to trust its timings."""
    print(f"load average (1, 5, 15 min) at the end: {', '.join(f'{v:.2f}' for v in os.getloadavg())}")


def modes_parser(
    doc: str, *, rounds: int, block: int, warmup: int, batch_size: int, seq_len: int = 64
) -> argparse.ArgumentParser:
    """The options of a benchmark that times modes of `TinyGPTJob` in interleaved rounds (the first line
    of `doc` is its description); the caller adds its own."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--block", type=int, default=block, help="steps per mode per round")
    p.add_argument("--warmup", type=int, default=warmup, help="untimed steps per mode first")
    p.add_argument("--batch-size", type=int, default=batch_size)
    p.add_argument("--seq-len", type=int, default=seq_len)
    return p


class TinyGPTJob:
    """One mode of a step-overhead benchmark: the tiny GPT preset from seed 0, its AdamW optimizer and its
    batches (`batch`), alike in every mode so that only what the mode changes differs. With `fp8` the
    model is converted to FP8 with `recipe` (delayed scaling), every layer ``fp8-train`` converts."""

    def __init__(self, args: argparse.Namespace, fp8: bool = True, device: str = "cpu"):
        import torch

        from fp8_trainer import convert_to_fp8
        from fp8_trainer.app.data import ByteCorpus
        from fp8_trainer.app.model import GPT, PRESETS, fp8_filter
        from fp8_trainer.recipe import DelayedScaling

        torch.manual_seed(0)
        self.args = args
        self.device = torch.device(device)
        self.recipe = DelayedScaling()
        self.model = GPT(PRESETS["tiny"]).to(self.device)
        if fp8:
            convert_to_fp8(self.model, recipe=self.recipe, module_filter_fn=fp8_filter)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.corpus = ByteCorpus(seed=0)

    def step(self) -> object:
        """One training step of this mode (each benchmark's job defines what it does and returns)."""
        raise NotImplementedError

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next training batch (`--batch-size` x `--seq-len`) on the job's device."""
        x, y = self.corpus.batch("train", self.args.batch_size, self.args.seq_len)
        return x.to(self.device), y.to(self.device)


def warm_up(jobs: Iterable[TinyGPTJob], steps: int) -> None:
    """`steps` untimed steps of every job first (plans, caches, the first scale updates)."""
    for job in jobs:
        for _ in range(steps):
            job.step()
