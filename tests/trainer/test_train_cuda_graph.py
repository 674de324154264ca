"""``fp8-train --cuda-graph`` on the CPU: everything but the capture itself.

The graphed loop (static input buffers filled per micro-batch, the learning rate handed in per step, the step
function ``GraphedStep`` would capture, the outputs copied) runs here with a runner that calls the step
eagerly, as ``GraphedStep``'s warm-up does, under ``HostSyncAudit``. It must train bit for bit as the eager
loop, and the step must not synchronise with the host, with every recipe (a CUDA graph could not capture a
step that does). The flags that cannot be captured are refused with a message. The capture and replay on a
GPU are ``test_cuda_graph_gpu.py``'s."""

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

from fp8_trainer.app import cli, train_graph
from fp8_trainer.app.train import train
from fp8_trainer.app.train_config import TrainConfig
from fp8_trainer.graphs import HostSyncAudit

pytestmark = pytest.mark.usefixtures("one_thread")


class EagerAuditedStep:
    """``GraphedStep``'s interface, calling the step eagerly every time (each call what a warm-up call does:
    the step, then the gradients set to None) under ``HostSyncAudit``. The optimizer's step runs outside
    the audit: on a GPU it is torch's capturable AdamW, which the CPU cannot run (its CPU AdamW reads the
    step counter on the host)."""

    instances: list["EagerAuditedStep"] = []

    def __init__(self, train_step, model, *, warmup: int, optimizer):
        self.train_step, self.model, self.optimizer = train_step, model, optimizer
        self.found: list[str] = []
        self.calls = 0
        step = optimizer.step

        def unaudited_step(*args, **kwargs):
            with _disable_current_modes():
                return step(*args, **kwargs)

        optimizer.step = unaudited_step
        EagerAuditedStep.instances.append(self)

    def __call__(self):
        self.calls += 1
        with HostSyncAudit() as audit:
            out = self.train_step()
        self.found += audit.found
        for p in self.model.parameters():
            p.grad = None
        return out


def _config(**kw) -> TrainConfig:
    base = dict(
        preset="tiny", steps=6, batch_size=4, seq_len=32, eval_interval=0, progress=False, lr=3e-3,
        min_lr=3e-4, warmup_steps=2, log_interval=100,
    )  # fmt: skip
    return TrainConfig(**{**base, **kw})


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe,grad_accum",
    [("delayed", 2), ("current", 1), ("mxfp8", 1), ("block", 2), ("bf16", 1)],
)
def test_graphed_loop_trains_as_the_eager_loop_without_host_syncs(monkeypatch, recipe, grad_accum):
    monkeypatch.setattr(train_graph, "GraphedStep", EagerAuditedStep)
    EagerAuditedStep.instances.clear()
    seen_eager, seen_graph = [], []
    eager = train(
        _config(recipe=recipe, grad_accum=grad_accum),
        on_step=lambda s, m, info: seen_eager.append((info["lr"], info["grad_norm"].item())),
        out=lambda s: None,
    )
    graphed = train(
        _config(recipe=recipe, grad_accum=grad_accum, cuda_graph=True),
        on_step=lambda s, m, info: seen_graph.append((info["lr"], info["grad_norm"].item())),
        out=lambda s: None,
    )
    (runner,) = EagerAuditedStep.instances
    assert runner.calls == 6  # one call per optimizer step, every micro-batch inside it
    assert runner.found == []  # nothing a CUDA graph could not capture
    assert graphed.losses == eager.losses  # bit for bit: same data, micro-batches, learning rates, clipping
    assert seen_graph == seen_eager
    for p, q in zip(eager.model.parameters(), graphed.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_audit_names_the_op_and_where_the_step_asked_for_it():
    x = torch.randn(8)
    with HostSyncAudit() as audit:
        if (x > 10).any():  # a branch on a tensor
            pass
        x[x > 0].sum()  # a boolean mask
        torch.nonzero(x)
        y = x * 2  # fine
        torch.equal(x, y)
    assert len(audit.found) == 4
    assert audit.found[0].startswith("aten._local_scalar_dense")
    assert "test_train_cuda_graph.py:" in audit.found[0]  # where the step asked for it
    assert audit.found[1].startswith("aten.index: indexing with a boolean mask")
    assert audit.found[2].startswith("aten.nonzero") and audit.found[3].startswith("aten.equal")
    with HostSyncAudit(device_types=("cuda",)) as on_gpu_only:  # GraphedStep's: CPU tensors are no wait
        x.sum().item()
    assert on_gpu_only.found == []
    with HostSyncAudit() as clean:
        torch.where(x > 0, x, 0.0).amax()  # the capturable way to write the same
        x[torch.argmax(x).reshape(1)]  # an integer index tensor: no read on the host
    assert clean.found == []


def test_cuda_graph_without_a_gpu_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--cuda-graph"])
    assert e.value.code == 2
    assert "--cuda-graph needs --device cuda" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"inject": ("lr-spike@3",)}, "--cuda-graph: --inject cannot be captured"),
        ({"halt_on_nonfinite": True}, "--cuda-graph: --halt-on-nonfinite cannot be captured"),
        ({"activation_checkpointing": "reentrant"}, "--cuda-graph: --activation-checkpointing cannot be"),
    ],
)
def test_what_cannot_be_captured_is_refused(kw, message):
    misfit = train_graph.graph_misfit(_config(device="cuda", cuda_graph=True, **kw), world=1)
    assert misfit.startswith(message)
    assert "data-parallel runs (2 ranks)" in train_graph.graph_misfit(_config(device="cuda"), world=2)
    assert train_graph.graph_misfit(_config(device="cuda"), world=1) is None
