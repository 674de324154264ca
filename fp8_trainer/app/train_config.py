"""``fp8-train``'s settings: every one with its default and its flag, in one block (``TrainConfig``)."""

from __future__ import annotations

from dataclasses import dataclass

from ..recipe import AMAX_COMPUTE_ALGOS
from .flags import flag
from .model import CHECKPOINT_MODES, PRESETS
from .schedule import LR_SCHEDULES

__all__ = ["FP8_RECIPES", "HISTORY_LEN", "TrainConfig"]

#: ``--recipe`` values that train in FP8: per-tensor scaling, MXFP8, FP8 block scaling (the others are the
#: bf16 / fp32 baselines)
FP8_RECIPES = ("delayed", "current", "mxfp8", "block")

#: fp8-train's amax history length where --amax-history-len is not given (see TrainConfig.amax_history_len)
HISTORY_LEN = 16

# the flags' groups in ``fp8-train --help``, in the order their first fields come
MODEL = "model and data"
RECIPE = "FP8 recipe"
OPTIMIZATION = "optimization"
OUTPUT = "evaluation, logging, checkpoints"
CAPTURE = "incident capture (replay a bundle with: fp8-train replay BUNDLE)"
MONITOR = "monitoring and fault injection"


@dataclass(frozen=True)
class TrainConfig:
    """Every ``fp8-train`` setting and its default, in one place: the flags are made from these fields
    (``flags.add_flags``: a field ``batch_size`` is the flag ``--batch-size``, its help and group in the
    field's ``flag``), ``prepare`` checks them and returns one of these, and ``train`` reads nothing else.
    Frozen: what a run was started with is what it ran with."""

    # ----- model and data -----
    preset: str = flag("tiny", MODEL, choices=list(PRESETS), help="model size (default %(default)s)")
    # None: the running Python's standard library source, byte-level
    data: str | None = flag(
        None, MODEL, help="text file (bytes) or .bin of uint16 token ids; default: stdlib source"
    )
    batch_size: int = flag(16, MODEL, help="sequences per micro-batch and rank (default %(default)s)")
    # at most the preset's block size
    seq_len: int = flag(64, MODEL, help="tokens per sequence (default %(default)s)")
    seed: int = flag(0, MODEL, help="weights, data order; a run is repeatable")
    # "cuda": FP8 recipes then run under bf16 autocast, as with Transformer Engine
    device: str = flag("cpu", MODEL, choices=("cpu", "cuda"))
    activation_checkpointing: str = flag(
        "none",
        MODEL,
        choices=CHECKPOINT_MODES,
        help="recompute each block in backward (torch.utils.checkpoint); the FP8 layers recompute "
        "in FP8 with the original scales (default %(default)s)",
    )
    # after the 3 eager steps (app.train_graph)
    cuda_graph: bool = flag(
        False,
        MODEL,
        help="capture each optimizer step in a CUDA graph after 3 eager steps and replay it: no "
        "host work per layer (--device cuda; not with --inject, --halt-on-nonfinite, "
        "--activation-checkpointing or several ranks)",
    )
    # each FP8 Linear two custom operators (fp8_trainer.linear_ops)
    compile: bool = flag(
        False,
        MODEL,
        help="torch.compile the model: one graph with the FP8 Linears as custom operators (block "
        "recipes: a graph break per layer); the first step compiles",
    )
    # fully_shard per block and on the root (fp8_trainer.fsdp); the sharded checkpoint directory is
    # torch.distributed.checkpoint's
    fsdp: bool = flag(
        False,
        MODEL,
        help="shard the model with FSDP2 (each block and the root) instead of DDP, the FP8 "
        "weights cast before the all-gather; --save / --resume then name a sharded "
        "checkpoint directory, which resumes on any number of ranks (not with --compile, "
        "--cuda-graph, --inject, --capture-dir)",
    )
    # fp8_trainer.tensor_parallel; the ranks of a group train the same batch, with --fsdp FSDP2 runs over
    # the mesh's first dimension
    tp: int = flag(
        1,
        MODEL,
        metavar="N",
        help="tensor parallelism over groups of N ranks (qkv and fc column-wise, proj and fc2 "
        "row-wise; N divides the preset's heads); alone every rank is in the group, with "
        "--fsdp a (ranks / N, N) mesh; per-tensor recipes only; --save / --resume as --fsdp "
        "(not with --compile, --cuda-graph, --inject, --capture-dir)",
    )
    # ----- FP8 recipe (None: the recipe's default, so a delayed-only flag given to another is refused) -----
    # "mxfp8": 1x32 blocks, E8M0 scales, dimensions and batch x seq_len divisible by 32; "block": 1x128
    # activations and gradients, 128x128 weights
    recipe: str = flag(
        "delayed",
        RECIPE,
        choices=(*FP8_RECIPES, "bf16", "fp32"),
        help="FP8 scaling (per tensor: delayed, current; block-scaled: mxfp8, block), or a "
        "baseline without FP8 (default %(default)s)",
    )
    # "hybrid": E4M3 forward, E5M2 backward. e4m3 for the block-scaled recipes as per-block scales cover
    # the gradients' range, and the block-scaled GEMMs take E4M3 operands only
    fp8_format: str | None = flag(
        None,
        RECIPE,
        choices=("hybrid", "e4m3"),
        help="default: hybrid for delayed and current, e4m3 for mxfp8 and block (as Transformer "
        "Engine's recipes)",
    )
    margin: int | None = flag(None, RECIPE, help="delayed scaling margin (default 0)")
    # None: HISTORY_LEN, not DelayedScaling's 1024 (Transformer Engine's default, which the library keeps):
    # an fp8-train run is hundreds of steps, and a 1024-step window would hold every scale at the largest
    # amax seen since the start, so that the falling activation and gradient amaxes of early training
    # underflow more and more; 16 steps let a scale follow its tensor
    amax_history_len: int | None = flag(None, RECIPE, help=f"default {HISTORY_LEN}")
    amax_compute_algo: str | None = flag(None, RECIPE, choices=AMAX_COMPUTE_ALGOS, help="default max")
    interval: int | None = flag(None, RECIPE, help="steps between scale updates (default 1)")
    power_2_scale: bool = flag(False, RECIPE, help="current scaling: round each scale down to a power of two")
    # ----- optimization (AdamW) -----
    steps: int = flag(200, OPTIMIZATION, help="optimizer steps (default %(default)s)")
    grad_accum: int = flag(1, OPTIMIZATION, help="micro-batches per optimizer step")
    lr: float = flag(1e-3, OPTIMIZATION, help="peak learning rate (AdamW)")
    min_lr: float | None = flag(None, OPTIMIZATION, help="final learning rate (default lr / 10)")
    warmup_steps: int | None = flag(None, OPTIMIZATION, help="default min(100, steps / 10)")
    lr_schedule: str = flag("cosine", OPTIMIZATION, choices=LR_SCHEDULES, help="after warmup")
    grad_clip: float = flag(1.0, OPTIMIZATION, help="max gradient norm (0: no clipping)")
    # ----- evaluation, logging, checkpoints -----
    eval_interval: int = flag(100, OUTPUT, help="steps between validation losses (0: none)")
    eval_iters: int = flag(8, OUTPUT, help="validation batches (the same every time)")
    log_interval: int = flag(20, OUTPUT, help="steps between log lines (no progress bar)")
    # on by default, so its flag is --no-progress
    progress: bool = flag(True, OUTPUT, help="no progress bar (it is also off when stderr is not a terminal)")
    save: str | None = flag(
        None, OUTPUT, metavar="PATH", help="checkpoint file; '{step}' in it keeps one per save"
    )
    save_interval: int = flag(0, OUTPUT, help="steps between checkpoints (0: at the end)")
    halt_on_nonfinite: bool = flag(
        False,
        OUTPUT,
        help="stop at the first non-finite loss, before the update, saving the previous step's weights with "
        "--save (exit code 3; costs one host sync per step)",
    )
    resume: str | None = flag(None, OUTPUT, metavar="PATH", help="continue the run saved in this checkpoint")
    stats_dump: str | None = flag(
        None,
        OUTPUT,
        metavar="FILE.npz",
        help="write every step's FP8 statistics and loss to FILE (numpy .npz: steps, "
        "stats (steps x tensors x 10, or 6 with --no-quality-stats), loss, names); copies "
        "them synchronously",
    )
    # ----- incident capture (fp8_trainer.app.incident_capture; replay with fp8-train replay BUNDLE) -----
    # None: off, but with a monitor (monitor_url) incidents/<run name>/ beside the --save file (else in the
    # working directory), unless capture is False
    capture_dir: str | None = flag(
        None,
        CAPTURE,
        metavar="DIR",
        help="at a non-finite loss or a loss spike, write an incident bundle (the step's "
        "batches, RNG, model, optimizer and FP8 state from before it) to DIR (default: "
        "with --monitor-url, incidents/RUN-NAME/ beside the --save file or in the working "
        "directory; else off)",
    )
    # --no-capture
    capture: bool = flag(
        True, CAPTURE, help="no incident capture, not even the default one with --monitor-url"
    )
    # a replay covers 8 to 16 steps
    capture_every: int = flag(
        8, CAPTURE, metavar="N", help="steps between the in-memory snapshots (default %(default)s)"
    )
    capture_max_mb: float = flag(
        512.0,
        CAPTURE,
        metavar="MB",
        help="the bundles in DIR together at most MB MiB (default %(default)s)",
    )
    # ----- monitoring and fault injection -----
    # their cost on the CPU path is about a tenth of a tiny-preset step (bench/quality_overhead.py)
    # --no-quality-stats
    quality_stats: bool = flag(
        True,
        MONITOR,
        help="leave the quantization-quality columns (SQNR, subnormals, dynamic range, outlier "
        "ratio) out of the quantize pass, to save their cost",
    )
    # FP8State.set_quality_schedule; None: 10 on CUDA (where the quantize kernels without them run about
    # 40% fewer instructions per element), 1 elsewhere
    quality_every: int | None = flag(
        None,
        MONITOR,
        metavar="N",
        help="the quality columns in every N-th step only, the others' quantize passes run the "
        "leaner kernels (default: 10 with --device cuda, else 1: every step)",
    )
    # the flag's default is $FP8SCOPE_URL where it is set
    monitor_url: str | None = flag(
        None,
        MONITOR,
        env="FP8SCOPE_URL",
        help="fp8-monitor root, e.g. http://127.0.0.1:8000 (default $FP8SCOPE_URL)",
    )
    run_name: str | None = flag(None, MONITOR, help="run name in the monitor (default: preset-recipe-time)")
    tags: tuple[str, ...] = flag(
        (), MONITOR, name="--tag", metavar="TAG", help="a tag of the run in the monitor; repeatable"
    )
    # "propose": a recipe change on the incident for a person to apply; "act": the job waits for the replay
    # and runs the failing step again under the change (app.retry)
    remediation: str = flag(
        "off",
        MONITOR,
        choices=("off", "propose", "act"),
        help="each incident bundle is replayed by the job; when the replay finds the incident FP8's "
        "fault, the monitor proposes a recipe change for the culprit layer (propose: the job trains on) "
        "or queues it (act: the job waits at the failing step, runs it again under the change, and the "
        "change is rolled back if the loss gets worse); default %(default)s",
    )
    token: str | None = flag(
        None,
        MONITOR,
        help="API token of the monitor (visible in the process list: prefer --token-file or $FP8SCOPE_TOKEN)",
    )
    token_file: str | None = flag(
        None, MONITOR, metavar="PATH", help="file whose first line is the monitor's API token"
    )
    inject: tuple[str, ...] = flag(
        (),
        MONITOR,
        metavar="SPEC",
        help="fault: overflow:LAYER@STEP[xFACTOR], nan:LAYER@STEP, lr-spike@STEP[xFACTOR], "
        "gradblowup:LAYER@STEP[xFACTOR], or "
        "FP8's own saturate:LAYER@STEP[xOFFSET], jump:LAYER@STEP[xFACTOR], "
        "lowprec:LAYER@STEP[xRANGE], gradspike:LAYER@STEP[xFACTOR] (repeatable; LAYER e.g. "
        "blocks.1.mlp.fc)",
    )
