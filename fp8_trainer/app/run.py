"""What one ``train`` call shares among the loop's parts (``Run``), and what it returns (``TrainResult``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .auto_replay import AutoReplay
from .data import Corpus
from .inject import Injector
from .progress import Progress
from .train_config import TrainConfig
from .train_graph import GraphedTraining

__all__ = ["Run", "TrainResult"]


@dataclass
class TrainResult:
    """The outcome of ``train`` on this rank."""

    losses: list[float]  # training loss of every step this run made (this rank's data)
    val_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, loss); rank 0 only
    model: nn.Module | None = None  # the trained model, unwrapped from DDP
    step: int = 0  # optimizer steps completed, counting those of a resumed checkpoint
    status: str = "finished"  # or "interrupted" (Ctrl-C), "halted" (--halt-on-nonfinite)


@dataclass
class Run:
    """One ``train`` call on this rank: what its loop's parts share instead of long argument lists."""

    a: TrainConfig
    corpus: Corpus
    recipe: Any  # the FP8 recipe; None for fp32 / bf16
    model: nn.Module  # the model itself: checkpoints, statistics, evaluation
    net: nn.Module  # what the step runs: the model, in DDP and / or compiled
    opt: torch.optim.Optimizer
    device: torch.device
    world: int
    lead: bool  # rank 0: prints, saves, keeps the validation losses
    start: int  # the step a resumed run starts after (0: a fresh run)
    config: dict[str, Any]  # the flags as the checkpoints and the monitor keep them (run_config)
    injector: Injector
    val_batches: list[tuple[torch.Tensor, torch.Tensor]]
    tokens_per_step: int
    progress: Progress
    result: TrainResult
    losses: torch.Tensor  # one slot per step: no allocation per step, one host copy at the end
    capture: Any = None  # --capture-dir: the incident capture (app.incident_capture)
    replays: AutoReplay | None = None  # --remediation: each bundle replayed in a child
    graphed: GraphedTraining | None = None  # --cuda-graph: the whole optimizer step, replayed
    monitor: Any = None  # the Monitor (or NoMonitor), once open
    on_step: Callable[[int, nn.Module, dict[str, Any]], None] | None = None
    dumped: list[torch.Tensor] = field(default_factory=list)  # --stats-dump: every step's statistics
    shown_url: bool = False  # the dashboard's address was printed
    reported: int = 0  # a step reported before its update (app.retry): not reported again after it

    def say(self, line: str) -> None:
        self.progress.say(line)
