"""``fp8-train``: train a GPT in FP8 (or a bf16 / fp32 baseline) and print its FP8 health.

The default data is the running Python's standard library source, byte-level. Data parallel when launched
with ``torchrun --nproc-per-node N``. With ``--monitor-url`` the run streams its health to fp8-monitor.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from urllib.parse import urlparse

import torch

from fp8_protocol.runs import check_tags

from .build import Prepared, dist_env, make_recipe, run_config
from .checkpoint import CheckpointError, check_compatible, check_layout, load_checkpoint
from .data import DataError, load_corpus
from .flags import add_flags, config_from_args
from .inject import check_injections, parse_injection
from .model import GPT, PRESETS, fp8_filter
from .report import health_table
from .train import train
from .train_config import FP8_RECIPES, TrainConfig
from .train_graph import graph_misfit

__all__ = ["TrainConfig", "build_parser", "health_table", "main", "make_recipe", "prepare"]

DELAYED_ONLY = ("margin", "amax_history_len", "amax_compute_algo", "interval")


def build_parser() -> argparse.ArgumentParser:
    """The ``fp8-train`` parser: one flag per ``TrainConfig`` field, in its groups (``flags.add_flags``)."""
    p = argparse.ArgumentParser(prog="fp8-train", description=__doc__.replace("``", ""))
    add_flags(p, TrainConfig)
    return p


def _fp8_layers(preset: str) -> list[str]:
    """Module paths of the preset's FP8 layers, from a narrow copy of it (same depth and names, no memory)."""
    cfg = replace(PRESETS[preset], vocab_size=16, block_size=8, n_head=1, n_embd=16)
    model = GPT(cfg)
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and fp8_filter(m, n)]


def _mxfp8_misfit(preset: str, tokens: int) -> str | None:
    """Why MXFP8 cannot run the preset with ``tokens`` tokens per micro-batch (every quantized dimension
    must be a multiple of 32), or None."""
    if tokens % 32:
        return f"--batch-size x --seq-len = {tokens} tokens per micro-batch, not a multiple of 32"
    with torch.device("meta"):  # shapes only, no memory
        model = GPT(replace(PRESETS[preset], vocab_size=16))
    for name, m in model.named_modules():
        if (
            isinstance(m, torch.nn.Linear)
            and fp8_filter(m, name)
            and (m.in_features % 32 or m.out_features % 32)
        ):
            return (
                f"preset {preset}: layer {name} is {m.in_features} -> {m.out_features}, not multiples of 32"
            )
    return None


def _fsdp_misfit(a: argparse.Namespace) -> str | None:
    """Why ``--fsdp`` cannot run with these flags, or None."""
    refused = {
        "--cuda-graph": (a.cuda_graph, "FSDP2's all-gathers and reduce-scatters are not captured"),
        "--compile": (a.compile, "the compiled FP8 Linear cannot take an FP8-gathered weight yet"),
        "--inject": (bool(a.inject), "fault injection edits whole weights, FSDP2 holds shards"),
        "--capture-dir": (a.capture_dir is not None, "incident bundles hold whole, unsharded models"),
    }
    for flag, (given, why) in refused.items():
        if given:
            return f"--fsdp: not with {flag} ({why})"
    return None


def _tp_misfit(a: argparse.Namespace, world: int) -> str | None:
    """Why ``--tp`` cannot run with these flags on ``world`` ranks, or None."""
    heads = PRESETS[a.preset].n_head
    if a.tp < 1:
        return f"--tp must be >= 1, got {a.tp}"
    if a.tp == 1:
        return None
    if heads % a.tp:
        return f"--tp {a.tp}: preset {a.preset}'s {heads} attention heads do not split over {a.tp} ranks"
    if a.recipe in ("mxfp8", "block"):
        return f"--tp: not with --recipe {a.recipe} (a row shard does not hold whole scaling blocks)"
    refused = {
        "--cuda-graph": a.cuda_graph,
        "--compile": a.compile,
        "--inject": bool(a.inject),
        "--capture-dir": a.capture_dir is not None,
    }
    for flag, given in refused.items():
        if given:
            return f"--tp: not with {flag} (as --fsdp)"
    if world % a.tp:
        return f"--tp {a.tp}: the {world} ranks do not split into groups of {a.tp}"
    if world != a.tp and not a.fsdp:
        return f"--tp {a.tp} on {world} ranks: data parallelism across the groups needs --fsdp"
    return None


def _check(p: argparse.ArgumentParser, a: argparse.Namespace) -> Prepared:
    """Refuse what cannot run (``p.error``: exit 2 with the message); fill in derived defaults (min_lr)."""
    _check_numbers(p, a)
    _check_recipe(p, a)
    _check_devices(p, a)
    _check_monitor(p, a)
    rank = dist_env()[0]
    corpus, checkpoint, injections = _load(p, a, rank)
    if rank == 0:
        _notes(a, injections)
    return Prepared(corpus=corpus, checkpoint=checkpoint)


def _check_numbers(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """The sizes, intervals and the learning rate; ``--min-lr`` defaults to a tenth of ``--lr``."""
    for name in ("steps", "batch_size", "seq_len", "grad_accum", "log_interval", "eval_iters"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("eval_interval", "save_interval"):
        if getattr(a, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    if a.seq_len > PRESETS[a.preset].block_size:
        p.error(
            f"--seq-len {a.seq_len} exceeds preset {a.preset}'s block size {PRESETS[a.preset].block_size}"
        )
    if not a.lr > 0:
        p.error("--lr must be > 0")
    if a.min_lr is None:
        a.min_lr = a.lr / 10
    elif not 0 <= a.min_lr <= a.lr:
        p.error(f"--min-lr must be between 0 and --lr {a.lr}")
    if a.warmup_steps is not None and not 0 <= a.warmup_steps <= a.steps:
        p.error(f"--warmup-steps must be between 0 and --steps {a.steps}")
    if a.grad_clip < 0:
        p.error("--grad-clip must be >= 0")


def _check_recipe(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """The recipe's flags, and that the recipe can be made from them."""
    fp8 = a.recipe in FP8_RECIPES
    if a.stats_dump and not fp8:
        p.error(f"--stats-dump needs an FP8 recipe ({', '.join(FP8_RECIPES)}), not --recipe {a.recipe}")
    if not fp8 and a.fp8_format is not None:
        p.error(f"--fp8-format needs an FP8 recipe ({', '.join(FP8_RECIPES)}), not --recipe {a.recipe}")
    if a.recipe == "mxfp8":
        misfit = _mxfp8_misfit(a.preset, a.batch_size * a.seq_len)
        if misfit:
            p.error(f"--recipe mxfp8: {misfit}")
    if a.power_2_scale and a.recipe != "current":
        p.error("--power-2-scale applies to --recipe current only")
    given = [n for n in DELAYED_ONLY if getattr(a, n) is not None]
    if given and a.recipe != "delayed":
        p.error(f"--{given[0].replace('_', '-')} applies to --recipe delayed only")
    try:
        make_recipe(a)
    except ValueError as e:
        p.error(str(e))


def _check_devices(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """The device, and how the run is laid out over ranks (``--fsdp``, ``--tp``, ``--cuda-graph``)."""
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device available")
    if a.quality_every is not None and a.quality_every < 1:
        p.error(f"--quality-every: expected an integer >= 1, got {a.quality_every}")
    if a.fsdp:
        misfit = _fsdp_misfit(a)
        if misfit:
            p.error(misfit)
    misfit = _tp_misfit(a, dist_env()[1])
    if misfit:
        p.error(misfit)
    if a.cuda_graph:
        misfit = graph_misfit(a, dist_env()[1])
        if misfit:
            p.error(misfit)


def _check_monitor(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """The monitor's flags, incident capture and checkpoint saving."""
    if a.remediation != "off" and not a.monitor_url:
        p.error("--remediation needs --monitor-url")
    for flag in ("run_name", "token", "token_file"):
        if getattr(a, flag) is not None and not a.monitor_url:
            p.error(f"--{flag.replace('_', '-')} needs --monitor-url")
    if a.monitor_url:
        url = urlparse(a.monitor_url)
        if url.scheme not in ("http", "https") or not url.netloc:
            p.error(f"--monitor-url {a.monitor_url!r}: expected http://HOST:PORT or https://HOST")
    if a.token_file is not None and a.token is not None:
        p.error("--token and --token-file: give one")
    try:
        check_tags(a.tags)
    except ValueError as e:
        p.error(f"--tag {str(e).removeprefix('tags: ')}")
    if a.token_file is not None:
        try:
            with open(a.token_file, encoding="utf-8") as f:
                if not f.readline().strip():
                    p.error(f"--token-file {a.token_file!r}: its first line is empty")
        except OSError as e:
            p.error(f"--token-file {a.token_file!r}: {e.strerror}")
    if not a.capture and a.capture_dir is not None:
        p.error("--no-capture and --capture-dir: choose one")
    if a.capture_every < 1:
        p.error("--capture-every must be >= 1")
    if not a.capture_max_mb > 0:
        p.error("--capture-max-mb must be > 0")
    if a.save_interval and not a.save:
        p.error("--save-interval needs --save PATH")


def _load(p: argparse.ArgumentParser, a: argparse.Namespace, rank: int):
    """The corpus, the checkpoint to resume and the faults to inject, each checked against the flags."""
    try:
        corpus = load_corpus(a.data, seed=a.seed, rank=rank // a.tp)  # a TP group trains one stream
    except DataError as e:
        p.error(f"--data {e}")
    try:
        corpus.check_length(a.seq_len)
    except DataError as e:
        p.error(f"--data {a.data or '(the standard library corpus)'}: {e}")
    checkpoint = None
    if a.resume:
        try:
            checkpoint = load_checkpoint(a.resume)
            check_compatible(checkpoint, run_config(a, corpus.vocab_size), a.steps)
            check_layout(checkpoint, a.fsdp or a.tp > 1)
        except CheckpointError as e:
            p.error(str(e) if str(e).startswith("--") else f"--resume {e}")
    try:
        injections = [parse_injection(s) for s in a.inject]
        first = checkpoint["step"] + 1 if checkpoint else 1
        check_injections(injections, _fp8_layers(a.preset), a.steps, first_step=first)
    except ValueError as e:
        p.error(str(e))
    return corpus, checkpoint, injections


def _notes(a: argparse.Namespace, injections) -> None:
    """Warnings about a run that will train, but perhaps not as its flags suggest (rank 0)."""
    if a.recipe == "current" and any(i.kind == "overflow" for i in injections):
        print(
            "note: with --recipe current each scale follows its tensor's own amax, so an injected "
            "overflow scales the weight without saturating it",
            file=sys.stderr,
        )
    if a.preset != "tiny" and a.device == "cpu":
        print(f"note: preset {a.preset} on the CPU will be very slow", file=sys.stderr)


def prepare(argv: list[str] | None = None) -> tuple[TrainConfig, Prepared]:
    """Parse and check ``fp8-train`` flags (exit 2 with a message on bad ones); return the configuration
    and the data and checkpoint they name, ready for ``train``."""
    p = build_parser()
    a = p.parse_args(argv)
    prepared = _check(p, a)
    return config_from_args(TrainConfig, a), prepared


EXIT_INTERRUPTED = 130  # the shell's code for a process stopped by SIGINT
EXIT_HALTED = 3  # --halt-on-nonfinite stopped the run


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fp8-train`` console script (``fp8-train replay``: ``fp8_trainer.app.replay``)."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["replay"]:
        from .replay import main as replay_main

        return replay_main(args[1:])
    try:
        a, prepared = prepare(argv)
        result = train(a, prepared, out=lambda s: print(s, flush=True))
    except KeyboardInterrupt:  # before the first step or while finishing: one line, no traceback
        print("fp8-train: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    return {"interrupted": EXIT_INTERRUPTED, "halted": EXIT_HALTED}.get(result.status, 0)


if __name__ == "__main__":
    sys.exit(main())
