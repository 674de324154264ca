"""``fp8-train``'s settings: every one with its default, in one commented block (``TrainConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["FP8_RECIPES", "HISTORY_LEN", "TrainConfig"]

#: ``--recipe`` values that train in FP8: per-tensor scaling, MXFP8, FP8 block scaling (the others are the
#: bf16 / fp32 baselines)
FP8_RECIPES = ("delayed", "current", "mxfp8", "block")


@dataclass(frozen=True)
class TrainConfig:
    """Every ``fp8-train`` setting and its default, in one place: the flags are made from these fields (a
    field ``batch_size`` is the flag ``--batch-size``), ``prepare`` checks them and returns one of these,
    and ``train`` reads nothing else. Frozen: what a run was started with is what it ran with."""

    # ----- model and data -----
    preset: str = "tiny"  # model size (fp8_trainer.app.model.PRESETS)
    data: str | None = None  # text file (bytes) or .bin of uint16 token ids; None: the stdlib source, bytes
    batch_size: int = 16  # sequences per micro-batch and rank
    seq_len: int = 64  # tokens per sequence (at most the preset's block size)
    seed: int = 0  # weights and data order: a run is repeatable
    device: str = "cpu"  # or "cuda": FP8 recipes then run under bf16 autocast, as with Transformer Engine
    activation_checkpointing: str = "none"  # recompute blocks in backward (model.CHECKPOINT_MODES)
    # capture each optimizer step in a CUDA graph after 3 eager steps and replay it (app.train_graph)
    cuda_graph: bool = False
    # torch.compile the model: one graph, each FP8 Linear two custom operators (fp8_trainer.linear_ops);
    # block-scaled layers are graph breaks
    compile: bool = False
    # shard the model with FSDP2 (fully_shard per block and on the root) instead of DDP, the FP8 weights
    # cast before the all-gather (fp8_trainer.fsdp); --save / --resume then use a sharded checkpoint
    # directory (torch.distributed.checkpoint) that resumes on another number of ranks
    fsdp: bool = False
    # tensor parallelism over groups of this many ranks (fp8_trainer.tensor_parallel): each block's qkv and
    # fc column-wise, proj and fc2 row-wise; the ranks of a group train the same batch. Alone, all ranks
    # form one group; with --fsdp a (world / tp, tp) mesh, FSDP2 over the first dimension
    tp: int = 1
    # ----- FP8 recipe (None: the recipe's default, so a delayed-only flag given to another is refused) -----
    # FP8 scaling "delayed" / "current" (per tensor), "mxfp8" (1x32 blocks, E8M0 scales; dimensions and
    # batch x seq_len divisible by 32) / "block" (FP8 block scaling: 1x128 activations and gradients, 128x128
    # weights), or a baseline "bf16" / "fp32"
    recipe: str = "delayed"
    # "hybrid" (E4M3 forward, E5M2 backward) or "e4m3"; None: the recipe's own default, as Transformer
    # Engine's: hybrid for delayed and current scaling, e4m3 for mxfp8 and block (per-block scales cover the
    # gradients' range, and the block-scaled GEMMs take E4M3 operands only)
    fp8_format: str | None = None
    margin: int | None = None  # delayed scaling margin; None: 0
    # amax history length; None: HISTORY_LEN (16), not DelayedScaling's 1024 (Transformer Engine's default,
    # which the library keeps): an fp8-train run is hundreds of steps, and a 1024-step window would hold
    # every scale at the largest amax seen since the start, so that the falling activation and gradient
    # amaxes of early training underflow more and more; 16 steps let a scale follow its tensor
    amax_history_len: int | None = None
    amax_compute_algo: str | None = None  # "max" or "most_recent"; None: max
    interval: int | None = None  # steps between scale updates; None: 1
    power_2_scale: bool = False  # current scaling: scales rounded down to powers of two
    # ----- optimization (AdamW) -----
    steps: int = 200  # optimizer steps
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 1e-3  # peak learning rate
    min_lr: float | None = None  # final learning rate; None: lr / 10
    warmup_steps: int | None = None  # None: min(100, steps / 10)
    lr_schedule: str = "cosine"  # after the warmup (fp8_trainer.app.schedule.LR_SCHEDULES)
    grad_clip: float = 1.0  # max gradient norm; 0: measured, not clipped
    # ----- evaluation, logging, checkpoints -----
    eval_interval: int = 100  # steps between validation losses; 0: none
    eval_iters: int = 8  # validation batches (the same every time)
    log_interval: int = 20  # steps between log lines (without a progress bar)
    progress: bool = True  # a progress bar (also off when stderr is not a terminal)
    save: str | None = None  # checkpoint file; "{step}" in it keeps one per save
    save_interval: int = 0  # steps between checkpoints; 0: at the end only
    halt_on_nonfinite: bool = False  # stop at the first non-finite loss, before the update (exit code 3)
    resume: str | None = None  # continue the run saved in this checkpoint
    stats_dump: str | None = None  # every step's FP8 statistics and loss to this .npz (synchronous copies)
    # ----- incident capture (fp8_trainer.app.incident_capture; replay with fp8-train replay BUNDLE) -----
    # write a bundle here at a non-finite loss or a loss spike; None: off, but with a monitor (monitor_url)
    # incidents/<run name>/ beside the --save file (else in the working directory), unless capture is False
    capture_dir: str | None = None
    capture: bool = True  # False (--no-capture): no capture, not even the default one with a monitor
    capture_every: int = 8  # steps between the in-memory snapshots (a replay covers 8 to 16 steps)
    capture_max_mb: float = 512.0  # the bundles in capture_dir together at most this many MiB
    # ----- monitoring and fault injection -----
    # the quality columns (SQNR, subnormals, dynamic range, outliers) in the quantize pass; off saves their
    # cost, which on the CPU path is about a tenth of a tiny-preset step (bench/quality_overhead.py)
    quality_stats: bool = True
    # the quality columns in every N-th step only (FP8State.set_quality_schedule); None: 10 on CUDA (where the
    # quantize kernels without them run about 40% fewer instructions per element), 1 elsewhere
    quality_every: int | None = None
    monitor_url: str | None = None  # fp8-monitor root; the flag's default is $FP8SCOPE_URL
    run_name: str | None = None  # None: preset-recipe-time
    tags: tuple[str, ...] = field(default_factory=tuple)  # the run's tags in the monitor
    # what the monitor does with a replayed incident it finds FP8's fault: "off", "propose" (a recipe change
    # on the incident for a person to apply) or "act" (the change queued, rolled back if the loss gets worse)
    remediation: str = "off"
    token: str | None = None  # API token (visible in the process list: prefer token_file or $FP8SCOPE_TOKEN)
    token_file: str | None = None  # file whose first line is the API token
    inject: tuple[str, ...] = field(
        default_factory=tuple
    )  # faults: overflow:LAYER@STEP[xF], nan:..., lr-spike@...


#: fp8-train's amax history length where --amax-history-len is not given (see TrainConfig.amax_history_len)
HISTORY_LEN = 16
