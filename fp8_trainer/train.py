"""The ``fp8-train`` loop, nanoGPT-style: per step accumulate, clip, step, log, evaluate, checkpoint.

``train(args)`` runs what the ``fp8-train`` flags describe (``cli.prepare`` builds and checks them) and can
be called in-process (benchmarks, tests). Data parallel when launched by ``torchrun``: every rank draws its
own data, DDP averages the gradients, and the FP8 layers all-reduce their amaxes (MAX) once per step, so
every rank keeps identical weights and scales. Only rank 0 prints and saves; every rank runs the monitor
client, which reports from rank 0. With ``--fsdp`` FSDP2 shards the model instead of DDP (``fully_shard``
per block and on the root, the FP8 weights cast before the all-gather: ``fp8_trainer.fsdp``); the data and
the amax reduction are as under DDP, every rank evaluates (a forward is a collective) and every rank writes
its shards of a sharded checkpoint (``fp8_trainer.checkpoint.save_sharded``).

Nothing in the step reads a device value on the host except at log, eval and checkpoint steps; the
progress bar shows the loss of the step before (copied asynchronously), and the monitor gets tensors.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from tqdm import tqdm

from fp8_protocol.replay import INCIDENT_BUNDLE_EVENT

from .auto_replay import AutoReplay
from .autocast import fp8_autocast
from .checkpoint import checkpoint_path, load_checkpoint, load_sharded, save_checkpoint, save_sharded
from .convert import convert_to_fp8, get_fp8_state
from .data import Corpus, load_corpus
from .hostcopy import LateCopy
from .inject import Injector, parse_injection
from .model import GPT, fp8_filter, preset_config
from .recipe import CurrentScaling, DelayedScaling, Float8BlockScaling, Format, MXFP8BlockScaling
from .report import fp8_summary, health_table
from .schedule import lr_at
from .stats import read_newest, step_stats
from .train_config import FP8_RECIPES, HISTORY_LEN, TrainConfig
from .train_graph import GraphedTraining, make_capturable

__all__ = ["Prepared", "TrainResult", "dist_env", "make_optimizer", "make_recipe", "run_config", "train"]


@dataclass
class Prepared:
    """What ``cli.prepare`` loaded while checking the flags, handed on so it is not loaded twice."""

    corpus: Corpus | None = None
    checkpoint: dict[str, Any] | None = None


@dataclass
class TrainResult:
    """The outcome of ``train`` on this rank."""

    losses: list[float]  # training loss of every step this run made (this rank's data)
    val_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss); rank 0 only
    model: nn.Module | None = None  # the trained model, unwrapped from DDP
    step: int = 0  # optimizer steps completed, counting those of a resumed checkpoint
    status: str = "finished"  # or "interrupted" (Ctrl-C), "halted" (--halt-on-nonfinite)


def dist_env() -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` as set by ``torchrun`` (``(0, 1, 0)`` otherwise)."""
    env = os.environ
    return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))


def make_recipe(a: TrainConfig):
    """The FP8 recipe the flags describe (``None`` for fp32 / bf16)."""
    block = a.recipe in ("mxfp8", "block")  # TE's block recipes default to E4M3 everywhere
    fmt = Format.parse(a.fp8_format or ("e4m3" if block else "hybrid"))
    if a.recipe == "delayed":
        return DelayedScaling(
            fp8_format=fmt,
            margin=a.margin if a.margin is not None else 0,
            amax_history_len=a.amax_history_len if a.amax_history_len is not None else HISTORY_LEN,
            amax_compute_algo=a.amax_compute_algo or "max",
            interval=a.interval if a.interval is not None else 1,
        )
    if a.recipe == "current":
        return CurrentScaling(fp8_format=fmt, power_2_scale=a.power_2_scale)
    if a.recipe == "mxfp8":
        return MXFP8BlockScaling(fp8_format=fmt)
    if a.recipe == "block":
        return Float8BlockScaling(fp8_format=fmt)
    return None


def run_config(a: TrainConfig, vocab_size: int) -> dict[str, Any]:
    """The flags as JSON-able data (for checkpoints and the monitor), without the secret token. A recipe flag
    left to its default holds the value the recipe used (``margin`` 0, not null), so the config says what
    was in force and a filter such as ``margin=0`` finds the runs that had it; a flag the recipe has no use
    for (``margin`` under current scaling) stays null."""
    values = vars(a) if isinstance(a, argparse.Namespace) else dataclasses.asdict(a)
    cfg = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items() if k != "token"}
    recipe = make_recipe(a)
    used = recipe.to_dict() if recipe is not None else {}
    for key, value in used.items():
        if key in cfg and cfg[key] is None:
            cfg[key] = value.lower() if key == "fp8_format" else value  # as the flag spells it
    return {**cfg, "vocab_size": vocab_size}


def warmup_steps(a: TrainConfig) -> int:
    """``--warmup-steps``, by default a tenth of the run up to 100 steps."""
    return a.warmup_steps if a.warmup_steps is not None else min(100, a.steps // 10)


class _Lagged:
    """A device scalar read on the host one step late, so showing it never stalls the GPU."""

    def __init__(self):
        self._late = LateCopy()

    def push(self, t: torch.Tensor) -> float | None:
        previous = self._late.swap(t)
        return None if previous is None else previous[1].item()  # started a step ago: complete


def _terminal_width() -> int:
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError):
        return 0


class _Progress:
    """What a run shows per step: a progress bar on a terminal, else a log line every ``log_interval`` steps
    (with the FP8 summary of the newest step), rank 0 only. ``say`` prints a line either way."""

    def __init__(self, a: TrainConfig, start: int, tokens_per_step: int, lead: bool, out):
        self.a, self.start, self.tokens_per_step, self.lead, self.out = a, start, tokens_per_step, lead, out
        show_bar = lead and a.progress and sys.stderr.isatty()
        width = _terminal_width() if show_bar else 0
        self.bar = tqdm(
            total=a.steps, initial=start, unit="step", file=sys.stderr, disable=not show_bar,
            # a terminal that reports no size (some ptys) would hide the bar: assume 100 x 24 there
            dynamic_ncols=width > 0, ncols=None if width > 0 else 100, nrows=None if width > 0 else 24,
        )  # fmt: skip
        self.lagged, self.smooth_tps = _Lagged(), None
        self.t_start = time.perf_counter()

    def say(self, line: str) -> None:
        if self.lead and self.bar.disable:
            self.out(line)
        elif self.lead:
            tqdm.write(line, file=sys.stdout)

    def show(
        self,
        step: int,
        loss: torch.Tensor,
        lr: float,
        now: float,
        tokens_per_s: float,
        monitor,
        model,
        recipe,
    ):
        """After optimizer step ``step`` (``now``: the host clock then)."""
        a = self.a
        if not self.bar.disable:
            shown = self.lagged.push(loss)  # the loss of the step before: no stall
            tps = self.smooth_tps
            self.smooth_tps = tokens_per_s if tps is None else 0.9 * tps + 0.1 * tokens_per_s
            postfix = {"tok/s": f"{self.smooth_tps:,.0f}", "incidents": monitor.open_incidents}
            if shown is not None:
                postfix = {"loss": f"{shown:.4f}", **postfix}
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update()
        elif self.lead and (step % a.log_interval == 0 or step == a.steps):
            elapsed = now - self.t_start  # averages since the start: steady numbers
            done = step - self.start
            line = f"step {step:5d}  loss {loss.item():.4f}  lr {lr:.3g}"
            line += f"  {elapsed / done * 1e3:.0f} ms/step"
            line += f"  {self.tokens_per_step * done / elapsed:,.0f} tok/s"
            if a.monitor_url:  # incidents, as the dashboard groups the alerts: one NaN is one, not dozens
                line += f"  incidents {monitor.open_incidents}"
                if monitor.open_alerts:
                    line += f" ({monitor.open_alerts} alerts)"
            self.say(line)
            if recipe is not None and step != a.steps:
                got = read_newest(model)  # synchronous, at log intervals only
                if got is not None:
                    self.say("           " + fp8_summary(got[1]))

    def close(self) -> None:
        self.bar.close()


class _NoMonitor:
    """Stands in for ``fp8_trainer.Monitor`` when no ``--monitor-url`` is given."""

    open_alerts = 0
    open_incidents = 0
    first_nonfinite = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def step(self, step: int, **scalars) -> None:
        pass

    def event(self, kind: str, step: int, **details) -> None:
        pass

    def close(self, status: str = "finished") -> None:
        pass

    run_id = dashboard_url = None


def _make_capture(a: TrainConfig, model, opt, config, world: int, say):
    """``--capture-dir``, or a monitor without ``--no-capture``: the incident capture
    (fp8_trainer.incident_capture), or None."""
    from .incident_capture import CaptureConfig, IncidentCapture, default_directory

    directory = a.capture_dir
    if directory is None and a.capture and a.monitor_url:
        name = a.run_name or f"{a.preset}-{a.recipe}-{datetime.now(UTC):%Y%m%d-%H%M%S}"
        directory = default_directory(a.save, name)
    if not directory:
        return None
    if world > 1 or a.cuda_graph or a.fsdp:
        say("note: incident capture covers single-process eager runs only (not several ranks, --cuda-graph, "
            "--fsdp): this run trains without it")  # fmt: skip
        return None
    if a.capture_dir is None:
        say(f"fp8-train: incident capture into {directory} (with a monitor; --no-capture: off)")
    cfg = CaptureConfig(directory, every=a.capture_every, max_bytes=int(a.capture_max_mb * 2**20))
    return IncidentCapture(cfg, model, opt, config)


def _make_monitor(a, model, recipe, config, rank: int, world: int):
    if not a.monitor_url:
        return _NoMonitor()
    from .monitor import Monitor  # imported only when monitoring: it pulls in the HTTP client

    run_name = a.run_name or f"{a.preset}-{a.recipe}-{datetime.now(UTC):%Y%m%d-%H%M%S}"
    if world > 1:  # every rank must name the same run: rank 0's clock decides
        names = [run_name]
        dist.broadcast_object_list(names, src=0)
        run_name = names[0]
    config = {**config, "run_name": run_name}
    token = a.token
    if a.token_file is not None:
        with open(a.token_file, encoding="utf-8") as f:
            token = f.readline().strip()
    return Monitor(
        a.monitor_url, run_name, model, recipe, token=token, config=config, tags=a.tags, announce=False
    )


@torch.no_grad()
def evaluate(model: nn.Module, batches, a: TrainConfig, recipe, device) -> float:
    """Mean loss over the fixed validation batches (FP8 forwards under no_grad record no statistics)."""
    model.eval()
    losses = []
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe), _bf16(a, device):
            losses.append(model(x, y)[1].float())
    model.train()
    return torch.stack(losses).mean().item()


def _bf16(a: TrainConfig, device: torch.device, cache: bool = True):
    """bf16 autocast for the bf16 baseline, and on a GPU also around FP8 recipes: what is not an FP8 GEMM
    (attention, LayerNorm, the output head) then runs in bf16 as in FP8 training with Transformer Engine, and
    tokens/s compare with the bf16 baseline. On the CPU, FP8 runs keep float32 elsewhere (bf16 is slow).
    ``cache=False`` in a captured step (autocast's weight-cast cache would outlive the capture)."""
    fp8_on_gpu = device.type == "cuda" and a.recipe in FP8_RECIPES
    enabled = a.recipe == "bf16" or fp8_on_gpu
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled, cache_enabled=cache)


def train(a: TrainConfig, prepared: Prepared | None = None, *, on_step=None, out=print) -> TrainResult:
    """Run the training the flags describe.

    Args:
        a: flags from ``cli.prepare`` (or ``cli.build_parser().parse_args`` for trusted input).
        prepared: corpus and checkpoint already loaded by ``cli.prepare`` (loaded here when missing).
        on_step: called as ``on_step(step, model, info)`` after every optimizer step on every rank, with
            ``info`` = ``{"loss": tensor, "lr": float, "grad_norm": tensor}`` (for tests and benchmarks).
        out: where rank 0's report lines go.
    """
    prepared = prepared or Prepared()
    rank, world, local_rank = dist_env()
    own_group = (world > 1 or a.fsdp) and not dist.is_initialized()
    if own_group:
        backend = "nccl" if a.device == "cuda" else "gloo"
        if world > 1 or "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend)
        else:  # --fsdp in one process not started by torchrun: a group of one, nothing to meet
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    device = torch.device(f"cuda:{local_rank}" if a.device == "cuda" else a.device)  # one GPU per rank
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        return _train(a, prepared, rank, world, device, on_step, out)
    finally:
        if own_group:
            dist.destroy_process_group()


def _build(a, prepared: Prepared, rank: int, device):
    """Data, model (converted to FP8 by the recipe), optimizer; restored from the checkpoint if resuming.

    Returns ``(corpus, recipe, model, optimizer, start_step, saved_streams)``.
    """
    torch.manual_seed(a.seed)  # the same initial weights on every rank
    data_rank = rank // a.tp  # the ranks of a tensor-parallel group train the same batches
    corpus = prepared.corpus or load_corpus(a.data, seed=a.seed, rank=data_rank)
    recipe = make_recipe(a)
    cfg = replace(preset_config(a.preset, corpus.vocab_size), checkpoint=a.activation_checkpointing)
    model = GPT(cfg).to(device)
    if recipe is not None:
        convert_to_fp8(model, recipe=recipe, module_filter_fn=fp8_filter)
        if not a.quality_stats:
            get_fp8_state(model).set_quality_stats(False)
        default_every = 10 if device.type == "cuda" else 1
        get_fp8_state(model).set_quality_schedule(a.quality_every or default_every)
    if a.tp > 1:
        mesh = tp_model(model, a.tp, device)
        if a.fsdp:
            shard_model(model, fp8=False, mesh=mesh["dp"])  # high-precision all-gather (docs/distributed.md)
    elif a.fsdp:
        shard_model(model, fp8=recipe is not None)
    opt = make_optimizer(a, model)  # after sharding: over the sharded parameters
    ckpt = prepared.checkpoint
    if ckpt is None and a.resume:
        ckpt = load_checkpoint(a.resume)
    if ckpt is not None and ckpt.get("sharded"):
        load_sharded(ckpt["sharded"], model=model, optimizer=opt)  # resharded to this run's ranks
        for group in opt.param_groups:
            group["capturable"] = False
    elif ckpt is not None:
        model.load_state_dict(ckpt["model"])  # FP8 scaling state included (each layer's _extra_state)
        opt.load_state_dict(ckpt["optimizer"])
        for group in opt.param_groups:  # as this run wants it, whatever the saving run was
            group["capturable"] = False
    if a.cuda_graph and device.type == "cuda":
        make_capturable(opt, device)
    if ckpt is None:
        return corpus, recipe, model, opt, 0, None
    torch.set_rng_state(ckpt["rng"]["torch"])
    if "cuda" in ckpt["rng"] and device.type == "cuda":
        torch.cuda.set_rng_state_all(ckpt["rng"]["cuda"])
    streams = ckpt["rng"]["data"]
    if data_rank < len(streams):
        corpus.generator.set_state(streams[data_rank])
    prepared.checkpoint = None  # model and optimizer hold copies now: free the memory
    return corpus, recipe, model, opt, ckpt["step"], len(streams)


def shard_model(model: GPT, fp8: bool, mesh=None) -> None:
    """FSDP2 on ``model`` in place, as ``docs/distributed.md`` writes it: the FP8 weights cast before the
    all-gather (``fp8``: the model is converted to FP8), ``fully_shard`` on each block and on the root (the
    embeddings, the final norm and the head tied to the embedding), over ``mesh`` (None: all ranks). Mixed
    precision stays autocast's (``_bf16``), as without FSDP2, so the parameters, the all-gathers that are
    not FP8 and the gradient reduce-scatter are float32."""
    from torch.distributed.fsdp import fully_shard

    from .fsdp import enable_fp8_all_gather

    if fp8:
        enable_fp8_all_gather(model)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def tp_model(model: GPT, tp: int, device):
    """Tensor parallelism on ``model`` in place (``--tp``): a ``(world / tp, tp)`` mesh (``("dp", "tp")``),
    each block's ``attn.qkv`` and ``mlp.fc`` column-wise and ``attn.proj`` and ``mlp.fc2`` row-wise over
    ``mesh["tp"]`` (the attention's head-major ``qkv`` gives each rank whole heads); the embeddings, the
    norms and the head stay whole on every rank. Returns the mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh(device.type, (dist.get_world_size() // tp, tp), mesh_dim_names=("dp", "tp"))
    plan = {}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.attn.qkv"] = ColwiseParallel()
        plan[f"blocks.{i}.attn.proj"] = RowwiseParallel()
        plan[f"blocks.{i}.mlp.fc"] = ColwiseParallel()
        plan[f"blocks.{i}.mlp.fc2"] = RowwiseParallel()
    parallelize_module(model, mesh["tp"], plan)
    return mesh


def make_optimizer(a: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """The run's optimizer (AdamW) over ``model``'s parameters."""
    return torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)


def step_lr(a: TrainConfig, step: int) -> float:
    """The scheduled learning rate of optimizer step ``step`` (before any injected spike)."""
    return lr_at(
        step,
        lr=a.lr,
        min_lr=a.min_lr,
        warmup_steps=warmup_steps(a),
        total_steps=a.steps,
        schedule=a.lr_schedule,
    )


def _train(a, prepared: Prepared, rank: int, world: int, device, on_step, out) -> TrainResult:
    # ----- setup: data, model, optimizer, checkpoint, progress bar, monitor -----
    corpus, recipe, model, opt, start, saved_streams = _build(a, prepared, rank, device)
    net = (
        nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        if world > 1 and not _sharded(a)
        else model  # under --fsdp / --tp the model is sharded already (shard_model, tp_model)
    )
    if a.compile:  # evaluation and checkpoints keep the eager model (no recompile for no_grad)
        net = torch.compile(net)
    config = run_config(a, corpus.vocab_size)
    injector = Injector(model, [parse_injection(s) for s in a.inject or ()])
    val_batches = corpus.val_batches(a.eval_iters, a.batch_size, a.seq_len) if a.eval_interval else []
    tokens_per_step = a.batch_size * a.seq_len * a.grad_accum * (world // a.tp)
    lead = rank == 0
    progress = _Progress(a, start, tokens_per_step, lead, out)
    say = progress.say
    capture = _make_capture(a, model, opt, config, world, say)
    replays = AutoReplay.for_job(a, capture, say)  # --remediation: each bundle replayed in a child

    n_params = sum(p.numel() for p in model.parameters())
    say(
        f"fp8-train: preset {a.preset}, recipe {a.recipe}"
        + (f" {recipe.to_dict()}" if recipe is not None else "")
        + f", {n_params / 1e6:.2f}M parameters, vocabulary {corpus.vocab_size}, device {device}"
        + (f", {world} ranks" if world > 1 else "")
        + (", FSDP2" if a.fsdp else "")
        + (f", tensor parallel over {a.tp}" if a.tp > 1 else "")
        + (f", resuming after step {start}" if start else "")
    )
    if saved_streams is not None and saved_streams < world:
        say(f"note: the checkpoint has data streams for {saved_streams} ranks; ranks beyond start fresh")
    result = TrainResult(losses=[], model=model, step=start)
    shown_url = False
    losses = torch.zeros(a.steps - start, device=device)  # one slot per step: no allocation per step
    dumped: list[torch.Tensor] = []  # --stats-dump: every step's statistics, copied synchronously
    graphed = None
    if a.cuda_graph:

        def captured(batches):  # the eager step's parts, from the static inputs (fp8_trainer.train_graph)
            loss = _forward_backward(a, net, batches, recipe, device, world, captured=True)
            return loss, _clip_and_step(a, model, opt)

        graphed = GraphedTraining(a, model, opt, device, captured)
    with _make_monitor(a, model, recipe, config, rank, world) as monitor:
        t_last = progress.t_start = time.perf_counter()
        try:
            for step in range(start + 1, a.steps + 1):
                # ----- learning rate and this step's injected faults -----
                lr = step_lr(a, step) * injector.lr_factor(step)
                if capture is not None:  # the state before the step's faults (fp8_trainer.incident_capture)
                    capture.begin(step, lr, injector.injections)
                for inj in injector.begin(step):
                    say(f"inject: step {step}: {inj.describe()}")
                    monitor.event("injection", step, **inj.details())

                if graphed is not None:  # the whole optimizer step, replayed (fp8_trainer.train_graph)
                    step_loss, grad_norm = graphed(corpus, lr)
                else:
                    for group in opt.param_groups:
                        group["lr"] = lr
                    batch = lambda _: _next_batch(a, corpus, device)  # noqa: E731
                    batch = capture.batches(batch) if capture is not None else batch
                    step_loss = _forward_backward(a, net, batch, recipe, device, world)
                injector.end(step)
                bundle = capture.end(step, step_loss) if capture is not None else None
                if bundle is not None:
                    say(f"fp8-train: step {step}: incident bundle {bundle} (fp8-train replay {bundle})")
                    monitor.event(INCIDENT_BUNDLE_EVENT, step, path=str(bundle))
                if replays is not None:  # starts a queued replay, reports an ended one: never waits
                    replays.after_step(step, bundle, monitor)

                if a.halt_on_nonfinite and _nonfinite(step_loss, world):  # before the update: a host sync
                    result.status = "halted"
                    say(f"fp8-train: halted: non-finite loss at step {step}; the weights are those of step "
                        f"{step - 1}")  # fmt: skip
                    monitor.step(step, loss=step_loss, lr=lr)  # the service sees the non-finite loss
                    opt.zero_grad(set_to_none=True)
                    break

                if graphed is None:
                    grad_norm = _optimizer_step(a, model, opt)
                result.step = step  # at once: an interrupt from here on leaves the weights of this step
                now = time.perf_counter()
                tokens_per_s = tokens_per_step / max(now - t_last, 1e-9)  # this step's (host clock)
                t_last = now
                monitor.step(step, loss=step_loss, lr=lr, grad_norm=grad_norm, tokens_per_s=tokens_per_s)
                if not shown_url and monitor.dashboard_url is not None:  # registered (in the background)
                    shown_url = True
                    say(f"fp8-train: dashboard {monitor.dashboard_url}")
                losses[step - start - 1] = step_loss
                if a.stats_dump and lead:
                    dumped.append(step_stats(model).to("cpu", copy=True))
                if on_step is not None:
                    on_step(step, model, {"loss": step_loss, "lr": lr, "grad_norm": grad_norm})

                progress.show(step, step_loss, lr, now, tokens_per_s, monitor, model, recipe)
                _evaluate_and_save(a, step, model, opt, val_batches, recipe, device, monitor, result, config,
                                   corpus, world, lead, say)  # fmt: skip
        except KeyboardInterrupt:  # Ctrl-C: one line, a checkpoint if asked for, the run "interrupted"
            result.status = "interrupted"
            say(f"fp8-train: interrupted after step {result.step}")
        finally:
            if replays is not None:  # a replay still running is stopped (fp8_trainer.auto_replay)
                replays.close(monitor, result.step)
        if result.status != "finished":
            _save_on_stop(a, model, opt, result, start, config, corpus, world, lead, say)
            monitor.close(result.status)
        if device.type == "cuda":
            torch.cuda.synchronize()
        progress.close()

    if recipe is not None and lead:
        got = read_newest(model)
        if got is not None:
            say(f"FP8 health after step {got[0]} (per layer; counts summed over input, weight, grad_output):")
            say(health_table(model, got[1]))
        first = monitor.first_nonfinite
        if first is not None:  # the worst tensor above is where a NaN spread to, not where it began
            say(f"first non-finite: {first[1]} at step {first[0]}")
    result.losses = losses[: result.step - start].tolist()  # one host copy, at the end
    if a.stats_dump and lead:
        _dump_stats(a.stats_dump, model, start, dumped, result.losses)
        say(f"statistics of {len(dumped)} steps written to {a.stats_dump}")
    if not all(math.isfinite(v) for v in result.losses):
        say("warning: non-finite training loss")
    return result


def _optimizer_step(a: TrainConfig, model: nn.Module, opt) -> torch.Tensor:
    """Clip (or only measure) the gradient norm, step, drop the gradients; the norm, on the device."""
    grad_norm = _clip_and_step(a, model, opt)
    opt.zero_grad(set_to_none=True)
    return grad_norm


def _clip_and_step(a: TrainConfig, model: nn.Module, opt) -> torch.Tensor:
    """Clip (or only measure) the gradient norm and step; the norm, on the device."""
    max_norm = a.grad_clip if a.grad_clip > 0 else math.inf  # inf: only measure the norm
    if a.tp > 1:
        grad_norm = clip_over_meshes(list(model.parameters()), max_norm)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if isinstance(grad_norm, DTensor):  # FSDP2's sharded gradients: the norm is replicated on every rank
        grad_norm = grad_norm.full_tensor()
    opt.step()
    return grad_norm


def clip_over_meshes(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` for gradients that live on different device meshes (under ``--tp`` with
    ``--fsdp`` the split layers' on the 2-D mesh, the rest on its dp dimension), which one norm over all of
    them cannot mix: the norm of each mesh's gradients, made whole (``full_tensor``), then their norm; each
    gradient scaled by the same clipping coefficient, replicated on its own mesh. Returns the total norm."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros(())
    total = torch.linalg.vector_norm(torch.stack(norms))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # as clip_grad_norm_
    for mesh, grads in groups.items():
        c = coef if mesh is None else DTensor.from_local(coef, mesh, [Replicate()] * mesh.ndim)
        for g in grads:
            g.mul_(c)
    return total


def _evaluate_and_save(
    a: TrainConfig,
    step,
    model,
    opt,
    val_batches,
    recipe,
    device,
    monitor,
    result,
    config,
    corpus,
    world,
    lead,
    say,
) -> None:
    """The validation loss at ``eval_interval`` and at the end (rank 0; every rank runs the forwards under
    FSDP2 and tensor parallelism, where they are collectives), a checkpoint at ``save_interval`` and at the
    end."""
    if a.eval_interval and (step % a.eval_interval == 0 or step == a.steps) and (lead or _sharded(a)):
        val = evaluate(model, val_batches, a, recipe, device)
        if lead:
            result.val_losses.append((step, val))
            say(f"step {step:5d}  val loss {val:.4f}")
            monitor.event("eval", step, val_loss=val)
    if a.save and ((a.save_interval and step % a.save_interval == 0) or step == a.steps):
        _save(a, model, opt, step, config, corpus, world, lead, say)


def _next_batch(a: TrainConfig, corpus: Corpus, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The corpus's next training micro-batch on ``device``, ``(B, T)`` each."""
    x, y = corpus.batch("train", a.batch_size, a.seq_len)
    if device.type == "cuda":  # pinned host memory: the copy overlaps the previous kernels
        x = x.pin_memory().to(device, non_blocking=True)
        y = y.pin_memory().to(device, non_blocking=True)
    return x, y


def _forward_backward(
    a, net: nn.Module, batches, recipe, device, world: int, captured: bool = False
) -> torch.Tensor:
    """One optimizer step's forward and backward over its micro-batches, micro-batch ``m`` from
    ``batches(m)`` (the FP8 step closes after the last); returns the step's mean loss, on the device.
    ``captured``: the step runs inside a CUDA graph (``_bf16``'s cache off)."""
    step_loss = torch.zeros((), device=device)
    for micro in range(a.grad_accum):
        x, y = batches(micro)
        last = micro == a.grad_accum - 1
        ddp = world > 1 and not _sharded(a)
        no_sync = net.no_sync() if ddp and not last else nullcontext()  # DDP: reduce once
        if a.fsdp:
            net.set_requires_gradient_sync(last)  # FSDP2's no_sync: reduce-scatter after the last only
        with no_sync:
            fp8 = fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe, step_boundary=last)
            with fp8, _bf16(a, device, cache=not captured):
                _, loss = net(x, y)
            (loss / a.grad_accum).backward()
        step_loss += loss.detach() / a.grad_accum
    return step_loss


def _sharded(a: TrainConfig) -> bool:
    """Whether the model's parameters are split over ranks (``--fsdp``, ``--tp``): no DDP, a collective
    evaluation, a sharded checkpoint."""
    return a.fsdp or a.tp > 1


def _nonfinite(loss: torch.Tensor, world: int) -> bool:
    """Whether this step's loss is non-finite on any rank (every rank gets the same answer)."""
    bad = (~torch.isfinite(loss)).float()
    if world > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bool(bad.item())


def _save_on_stop(a, model, opt, result: TrainResult, start: int, config, corpus, world: int, lead, say):
    """On Ctrl-C or a halt: the checkpoint of the last completed step, if ``--save`` was given."""
    if not a.save:
        return
    if result.step <= start:
        say("fp8-train: no step completed; nothing saved")
    elif world > 1 and result.status == "interrupted":  # saving is a collective: ranks may have stopped apart
        say("fp8-train: not saved: the ranks of an interrupted job may have stopped at different steps")
    else:
        _save(a, model, opt, result.step, config, corpus, world, lead, say)


def _save(a, model, opt, step: int, config, corpus: Corpus, world: int, lead: bool, say) -> None:
    """Rank 0 writes the checkpoint, with every rank's data-stream state (gathered: a collective); under
    FSDP2 every rank writes its shards of a sharded checkpoint directory."""
    states = [corpus.generator.get_state()]
    if world > 1:
        states = [None] * world
        dist.all_gather_object(states, corpus.generator.get_state())
    states = states[:: a.tp]  # one stream per tensor-parallel group, which all its ranks train
    if _sharded(a):
        path = checkpoint_path(a.save, step)
        save_sharded(path, model=model, optimizer=opt, step=step, config=config, data_rng=states)
        say(f"step {step:5d}  saved {path} (sharded)")
    elif lead:
        path = checkpoint_path(a.save, step)
        save_checkpoint(path, model=model, optimizer=opt, step=step, config=config, data_rng=states)
        say(f"step {step:5d}  saved {path}")


def _same_width(stats: list[torch.Tensor]) -> torch.Tensor:
    """The steps' statistics stacked, the quality columns NaN in the steps that did not record them
    (``--quality-every``) where others did."""
    if not stats:
        return torch.empty((0, 0, 0), dtype=torch.float64)
    width = max(s.shape[1] for s in stats)
    out = torch.full((len(stats), stats[0].shape[0], width), float("nan"), dtype=torch.float64)
    for i, s in enumerate(stats):
        out[i, :, : s.shape[1]] = s
    return out


def _dump_stats(path: str, model: nn.Module, start: int, stats: list[torch.Tensor], losses: list[float]):
    """``--stats-dump``: the run's per-step statistics as arrays, for comparing with what a monitor stored."""
    import numpy as np

    from .convert import tensor_table

    np.savez(
        path,
        steps=np.arange(start + 1, start + 1 + len(stats), dtype=np.int64),
        stats=_same_width(stats).numpy(),  # (steps, tensors, 10) in STAT_COLUMNS order
        loss=np.asarray(losses, dtype=np.float64),
        names=np.asarray([t.name for t in tensor_table(model)]),
    )
