"""The ``fp8-train`` loop, nanoGPT-style: per step accumulate, clip, step, log, evaluate, checkpoint.

``train(args)`` runs what the ``fp8-train`` flags describe (``cli.prepare`` builds and checks them) and can
be called in-process (benchmarks, tests). Data parallel when launched by ``torchrun``: every rank draws its
own data, DDP averages the gradients, and the FP8 layers all-reduce their amaxes (MAX) once per step, so
every rank keeps identical weights and scales. Only rank 0 prints and saves; every rank runs the monitor
client, which reports from rank 0. With ``--fsdp`` FSDP2 shards the model instead of DDP (``fully_shard``
per block and on the root, the FP8 weights cast before the all-gather: ``fp8_trainer.fsdp``); the data and
the amax reduction are as under DDP, every rank evaluates (a forward is a collective) and every rank writes
its shards of a sharded checkpoint (``fp8_trainer.app.checkpoint.save_sharded``).

What a run is made of is built in ``build.py``, the parts of a step are in ``train_step.py`` and what it
shows is ``progress.py``'s; the loop's parts share one ``Run``. Nothing in the step reads a device value on
the host except at log, eval and checkpoint steps; the progress bar shows the loss of the step before
(copied asynchronously), and the monitor gets tensors.
"""

from __future__ import annotations

import math
import os
import time
from datetime import UTC, datetime
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fp8_protocol.replay import INCIDENT_BUNDLE_EVENT

from ..stats import read_newest, step_stats
from .auto_replay import AutoReplay
from .build import Prepared, build, dist_env, run_config, step_lr
from .checkpoint import TrainingState, checkpoint_path, save_checkpoint, save_sharded
from .inject import Injector, parse_injection
from .progress import NoMonitor, Progress
from .report import health_table
from .retry import at_incident
from .run import Run, TrainResult
from .train_config import TrainConfig
from .train_graph import GraphedTraining
from .train_step import (
    clip_and_step,
    evaluate,
    forward_backward,
    next_batch,
    nonfinite,
    optimizer_step,
    sharded,
)

__all__ = ["Run", "TrainResult", "train"]


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
        run = _setup(a, prepared, rank, world, device, out)
        run.on_step = on_step
        result = _train(run, rank)
        if own_group and world > 1:
            # every rank past its last collective before any tears the group down: a gloo group destroyed
            # while a peer is still finishing could leave destroy_process_group waiting for good
            dist.barrier()
        return result
    finally:
        if own_group:
            dist.destroy_process_group()


def _train(run: Run, rank: int) -> TrainResult:
    """The run: its steps with the monitor open, then the report of how it ended."""
    a, result = run.a, run.result
    with _make_monitor(a, run.model, run.recipe, run.config, rank, run.world) as run.monitor:
        try:
            _loop(run)
        except KeyboardInterrupt:  # Ctrl-C: one line, a checkpoint if asked for, the run "interrupted"
            result.status = "interrupted"
            run.say(f"fp8-train: interrupted after step {result.step}")
        finally:
            if run.replays is not None:  # a replay still running is stopped (app.auto_replay)
                run.replays.close(run.monitor, result.step)
        if result.status != "finished":
            _save_on_stop(run)
            run.monitor.close(result.status)
        if run.device.type == "cuda":
            torch.cuda.synchronize()
        run.progress.close()
    return _finish(run)


def _loop(run: Run) -> None:
    """The optimizer steps after ``start`` up to ``--steps``, or to a halt."""
    a, result = run.a, run.result
    t_last = run.progress.t_start = time.perf_counter()
    for step in range(run.start + 1, a.steps + 1):
        # ----- learning rate and this step's injected faults -----
        lr = _begin_step(run, step)
        # ----- forward and backward (--cuda-graph: the whole optimizer step, replayed) -----
        step_loss, grad_norm = _forward_backward(run, lr)
        step_loss = _end_faults(run, step, lr, step_loss)  # --remediation act: maybe the step ran again
        if a.halt_on_nonfinite and nonfinite(step_loss, run.world):  # before the update: a host sync
            _halt(run, step, step_loss, lr)
            break
        # ----- the update -----
        if grad_norm is None:
            grad_norm = optimizer_step(a, run.model, run.opt)
        result.step = step  # at once: an interrupt from here on leaves the weights of this step
        now = time.perf_counter()
        tokens_per_s = run.tokens_per_step / max(now - t_last, 1e-9)  # this step's (host clock)
        t_last = now
        # ----- report, evaluate, checkpoint -----
        _report_step(run, step, {"loss": step_loss, "lr": lr, "grad_norm": grad_norm}, tokens_per_s)
        run.progress.show(step, step_loss, lr, now, tokens_per_s, run.monitor, run.model, run.recipe)
        _evaluate_and_save(run, step)


def _setup(a: TrainConfig, prepared: Prepared, rank: int, world: int, device, out) -> Run:
    """Data, model, optimizer, checkpoint (``build``); the model wrapped for the step; progress bar,
    incident capture, replays; the run announced."""
    corpus, recipe, model, opt, start, saved_streams = build(a, prepared, rank, device)
    net = (
        nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        if world > 1 and not sharded(a)
        else model  # under --fsdp / --tp the model is sharded already (shard_model, tp_model)
    )
    if a.compile:  # evaluation and checkpoints keep the eager model (no recompile for no_grad)
        net = torch.compile(net)
    config = run_config(a, corpus.vocab_size)
    injector = Injector(model, [parse_injection(s) for s in a.inject or ()])
    val_batches = corpus.val_batches(a.eval_iters, a.batch_size, a.seq_len) if a.eval_interval else []
    tokens_per_step = a.batch_size * a.seq_len * a.grad_accum * (world // a.tp)
    lead = rank == 0
    progress = Progress(a, start, tokens_per_step, lead, out)
    run = Run(
        a=a,
        corpus=corpus,
        recipe=recipe,
        model=model,
        net=net,
        opt=opt,
        device=device,
        world=world,
        lead=lead,
        start=start,
        config=config,
        injector=injector,
        val_batches=val_batches,
        tokens_per_step=tokens_per_step,
        progress=progress,
        result=TrainResult(losses=[], model=model, step=start),
        losses=torch.zeros(a.steps - start, device=device),
    )
    run.capture = _make_capture(a, model, opt, config, world, run.say)
    run.replays = AutoReplay.for_job(a, run.capture, run.say)  # --remediation: each bundle replayed
    _announce(run, saved_streams)
    if a.cuda_graph:
        run.graphed = _graphed(run)
    return run


def _announce(run: Run, saved_streams: int | None) -> None:
    a, recipe = run.a, run.recipe
    n_params = sum(p.numel() for p in run.model.parameters())
    run.say(
        f"fp8-train: preset {a.preset}, recipe {a.recipe}"
        + (f" {recipe.to_dict()}" if recipe is not None else "")
        + f", {n_params / 1e6:.2f}M parameters, vocabulary {run.corpus.vocab_size}, device {run.device}"
        + (f", {run.world} ranks" if run.world > 1 else "")
        + (", FSDP2" if a.fsdp else "")
        + (f", tensor parallel over {a.tp}" if a.tp > 1 else "")
        + (f", resuming after step {run.start}" if run.start else "")
    )
    if saved_streams is not None and saved_streams < run.world:
        run.say(f"note: the checkpoint has data streams for {saved_streams} ranks; ranks beyond start fresh")


def _graphed(run: Run) -> GraphedTraining:
    """``--cuda-graph``: the optimizer step captured from the eager step's parts, from the static inputs
    (``app.train_graph``)."""
    a = run.a

    def captured(batches):
        loss = forward_backward(a, run.net, batches, run.recipe, run.device, run.world, captured=True)
        return loss, clip_and_step(a, run.model, run.opt)

    return GraphedTraining(a, run.model, run.opt, run.device, captured)


def _begin_step(run: Run, step: int) -> float:
    """The step's learning rate; its injected faults begin (the capture keeps the state before them)."""
    lr = step_lr(run.a, step) * run.injector.lr_factor(step)
    if run.capture is not None:  # the state before the step's faults (app.incident_capture)
        run.capture.begin(step, lr, run.injector.injections)
    for inj in run.injector.begin(step):
        run.say(f"inject: step {step}: {inj.describe()}")
        run.monitor.event("injection", step, **inj.details())
    return lr


def _forward_backward(run: Run, lr: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The step's mean loss, on the device; and under ``--cuda-graph``, which replays the whole optimizer
    step, its gradient norm (None: the update is still to come)."""
    if run.graphed is not None:
        return run.graphed(run.corpus, lr)
    for group in run.opt.param_groups:
        group["lr"] = lr
    batch = lambda _: next_batch(run.a, run.corpus, run.device)  # noqa: E731
    batch = run.capture.batches(batch) if run.capture is not None else batch
    return forward_backward(run.a, run.net, batch, run.recipe, run.device, run.world), None


def _end_faults(run: Run, step: int, lr: float, step_loss: torch.Tensor) -> torch.Tensor:
    """The step's faults end; a bundle the capture wrote is announced and replayed: beside training, or
    with ``--remediation act`` at once, the step then maybe run again (``app.retry``). The step's loss."""
    run.injector.end(step)
    bundle = run.capture.end(step, step_loss) if run.capture is not None else None
    if bundle is not None:
        run.say(f"fp8-train: step {step}: incident bundle {bundle} (fp8-train replay {bundle})")
        if run.replays is not None and run.a.remediation == "act":
            step_loss, bundle = at_incident(run, step, lr, step_loss, bundle), None
        else:
            run.monitor.event(INCIDENT_BUNDLE_EVENT, step, path=str(bundle))
    if run.replays is not None:  # starts a queued replay, reports an ended one: never waits
        run.replays.after_step(step, bundle, run.monitor)
    return step_loss


def _halt(run: Run, step: int, step_loss: torch.Tensor, lr: float) -> None:
    """``--halt-on-nonfinite``: the run stops before this step's update."""
    run.result.status = "halted"
    run.say(f"fp8-train: halted: non-finite loss at step {step}; the weights are those of step {step - 1}")
    if run.reported != step:
        run.monitor.step(step, loss=step_loss, lr=lr)  # the service sees the non-finite loss
    run.opt.zero_grad(set_to_none=True)


def _report_step(run: Run, step: int, info: dict[str, Any], tokens_per_s: float) -> None:
    """The step to the monitor, the losses, ``--stats-dump`` and ``on_step``."""
    if run.reported != step:
        run.monitor.step(step, **info, tokens_per_s=tokens_per_s)
    if not run.shown_url and run.monitor.dashboard_url is not None:  # registered (in the background)
        run.shown_url = True
        run.say(f"fp8-train: dashboard {run.monitor.dashboard_url}")
    run.losses[step - run.start - 1] = info["loss"]
    if run.a.stats_dump and run.lead:
        run.dumped.append(step_stats(run.model).to("cpu", copy=True))
    if run.on_step is not None:
        run.on_step(step, run.model, info)


def _finish(run: Run) -> TrainResult:
    """The FP8 health table and the first non-finite tensor (rank 0), the losses copied to the host,
    ``--stats-dump`` written."""
    a, result = run.a, run.result
    if run.recipe is not None and run.lead:
        got = read_newest(run.model)
        if got is not None:
            per_layer = "per layer; counts summed over input, weight, grad_output"
            run.say(f"FP8 health after step {got[0]} ({per_layer}):")
            run.say(health_table(run.model, got[1]))
        first = run.monitor.first_nonfinite
        if first is not None:  # the worst tensor above is where a NaN spread to, not where it began
            run.say(f"first non-finite: {first[1]} at step {first[0]}")
    result.losses = run.losses[: result.step - run.start].tolist()  # one host copy, at the end
    if a.stats_dump and run.lead:
        _dump_stats(a.stats_dump, run.model, run.start, run.dumped, result.losses)
        run.say(f"statistics of {len(run.dumped)} steps written to {a.stats_dump}")
    if not all(math.isfinite(v) for v in result.losses):
        run.say("warning: non-finite training loss")
    return result


def _make_capture(a: TrainConfig, model, opt, config, world: int, say):
    """``--capture-dir``, or a monitor without ``--no-capture``: the incident capture
    (fp8_trainer.app.incident_capture), or None."""
    from .incident_capture import CaptureConfig, IncidentCapture, default_directory

    directory = a.capture_dir
    if directory is None and a.capture and a.monitor_url:
        name = a.run_name or f"{a.preset}-{a.recipe}-{datetime.now(UTC):%Y%m%d-%H%M%S}"
        directory = default_directory(a.save, name)
    if not directory:
        return None
    if world > 1 or a.cuda_graph or a.fsdp:
        say(
            "note: incident capture covers single-process eager runs only (not several ranks, --cuda-graph, "
            "--fsdp): this run trains without it"
        )
        return None
    if a.capture_dir is None:
        say(f"fp8-train: incident capture into {directory} (with a monitor; --no-capture: off)")
    cfg = CaptureConfig(directory, every=a.capture_every, max_bytes=int(a.capture_max_mb * 2**20))
    return IncidentCapture(cfg, model, opt, config, rerun=a.remediation == "act")


def _make_monitor(a, model, recipe, config, rank: int, world: int):
    if not a.monitor_url:
        return NoMonitor()
    from ..monitor import Monitor  # imported only when monitoring: it pulls in the HTTP client

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


def _evaluate_and_save(run: Run, step: int) -> None:
    """The validation loss at ``eval_interval`` and at the end (rank 0; every rank runs the forwards under
    FSDP2 and tensor parallelism, where they are collectives), a checkpoint at ``save_interval`` and at the
    end."""
    a = run.a
    if a.eval_interval and (step % a.eval_interval == 0 or step == a.steps) and (run.lead or sharded(a)):
        val = evaluate(run.model, run.val_batches, a, run.recipe, run.device)
        if run.lead:
            run.result.val_losses.append((step, val))
            run.say(f"step {step:5d}  val loss {val:.4f}")
            run.monitor.event("eval", step, val_loss=val)
    if a.save and ((a.save_interval and step % a.save_interval == 0) or step == a.steps):
        _save(run, step)


def _save_on_stop(run: Run) -> None:
    """On Ctrl-C or a halt: the checkpoint of the last completed step, if ``--save`` was given."""
    result = run.result
    if not run.a.save:
        return
    if result.step <= run.start:
        run.say("fp8-train: no step completed; nothing saved")
    elif run.world > 1 and result.status == "interrupted":  # a save is collective: ranks may differ
        run.say("fp8-train: not saved: the ranks of an interrupted job may have stopped at different steps")
    else:
        _save(run, result.step)


def _save(run: Run, step: int) -> None:
    """Rank 0 writes the checkpoint, with every rank's data-stream state (gathered: a collective); under
    FSDP2 every rank writes its shards of a sharded checkpoint directory."""
    a, generator = run.a, run.corpus.generator
    states = [generator.get_state()]
    if run.world > 1:
        states = [None] * run.world
        dist.all_gather_object(states, generator.get_state())
    states = states[:: a.tp]  # one stream per tensor-parallel group, which all its ranks train
    saved = TrainingState(model=run.model, optimizer=run.opt, step=step, config=run.config, data_rng=states)
    if sharded(a):
        path = checkpoint_path(a.save, step)
        save_sharded(path, saved)
        run.say(f"step {step:5d}  saved {path} (sharded)")
    elif run.lead:
        path = checkpoint_path(a.save, step)
        save_checkpoint(path, saved)
        run.say(f"step {step:5d}  saved {path}")


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

    from ..convert import tensor_table

    np.savez(
        path,
        steps=np.arange(start + 1, start + 1 + len(stats), dtype=np.int64),
        stats=_same_width(stats).numpy(),  # (steps, tensors, 10) in STAT_COLUMNS order
        loss=np.asarray(losses, dtype=np.float64),
        names=np.asarray([t.name for t in tensor_table(model)]),
    )
