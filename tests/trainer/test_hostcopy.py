"""The one-step-late host copy (``LateCopy``), the readers' shared poll / advance / flush (``LateReader``)
and the step tracker the FP8 layers keep their step-boundary flags in."""

import torch
from torch import nn

import fp8_trainer
from fp8_trainer import DelayedScaling, StatsReader, fp8_autocast
from fp8_trainer.hostcopy import LateCopy
from fp8_trainer.state import StepTracker
from fp8_trainer.stats import LateReader


def test_late_copy_hands_back_the_previous_copy_with_its_tag():
    late = LateCopy()
    x = torch.tensor([1.0, 2.0])
    assert late.swap(x, "first") is None
    x.add_(10)  # the copy is a snapshot of the value when it started
    tag, host = late.swap(torch.tensor([3.0]), "second")
    assert tag == "first" and host.tolist() == [1.0, 2.0]
    tag, host = late.swap(None)  # nothing new: the pipeline empties
    assert tag == "second" and host.tolist() == [3.0]
    assert late.flush() is None
    late.swap(torch.zeros(1), 1)
    late.clear()
    assert late.flush() is None


class _Blocks(LateReader):
    """A reader over a list of blocks put by the test, as CallerStats is over the caller's."""

    def __init__(self):
        super().__init__()
        self.new = None
        self.merged = 0

    def take(self):
        got, self.new = self.new, None
        return got

    def _hand_out(self, n, host):
        self.merged = n
        return 7, host


def test_late_reader_poll_advance_flush_are_one_step_late():
    r = _Blocks()
    assert r.advance() == (False, None)
    r.new = (torch.full((2, 6), 1.0), 1)
    assert r.advance() == (True, None)  # started, not handed out yet
    r.new = (torch.full((2, 6), 2.0), 3)
    ran, (step, host) = r.advance()
    assert ran and step == 7 and r.merged == 1 and host[0, 0] == 1.0
    assert r.poll() is None  # nothing new: no second copy, the one in flight stays
    step, host = r.flush()
    assert r.merged == 3 and host[0, 0] == 2.0
    assert r.flush() is None
    ran, previous = r.advance()  # nothing new, nothing in flight
    assert not ran and previous is None


def test_stats_reader_and_the_monitor_readers_share_the_late_reader():
    from fp8_trainer.integrations.transformer_engine import TEStats
    from fp8_trainer.monitor.external import CallerStats

    assert issubclass(StatsReader, LateReader)
    assert issubclass(CallerStats, LateReader) and issubclass(TEStats, LateReader)


def test_the_step_flags_live_in_the_tracker_and_pending_still_reads_through():
    torch.manual_seed(0)
    model = fp8_trainer.convert_to_fp8(nn.Sequential(nn.Linear(16, 16)), recipe=DelayedScaling())
    state = fp8_trainer.get_fp8_state(model)
    assert isinstance(state.tracker, StepTracker) and not state.pending
    x = torch.randn(4, 16, requires_grad=True)
    with fp8_autocast():
        loss = model(x).square().mean()
    assert state.pending and state.tracker.pending and state.tracker.step_complete
    assert state.tracker.forward_recorded == {(0, 1)}  # layer 0, its first forward
    loss.backward()  # the end of the backward closes the step
    assert not state.pending and state.steps == 1
    assert not state.tracker.forward_recorded and not state.tracker.callback_queued
