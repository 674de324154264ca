"""The client's loss-spike events follow the service's rule: on a steeply falling loss, a +57% jump (what a
learning-rate spike does) is one event at its step on both sides, and ordinary noise is none."""

from __future__ import annotations

import numpy as np

from fp8_trainer.monitor.detect import DetectConfig, Detector
from fp8_trainer.monitor.sender import StepRecord
from monitor_server.core.detector_config import DetectorConfig
from monitor_server.detectors.loss import LossSpikeDetector


def falling_loss(n: int, seed: int, jump_at: int | None = None) -> np.ndarray:
    rng = np.random.default_rng(seed)
    steps = np.arange(1, n + 1)
    loss = 2.4 + 3.0 * np.exp(-steps / 15.0) + rng.normal(0.0, 0.01, n)
    if jump_at is not None:
        loss[jump_at - 1] *= 1.57
    return loss


def client_spikes(loss: np.ndarray) -> list[int]:
    det = Detector(DetectConfig())
    out = []
    for step, x in enumerate(loss.tolist(), start=1):
        events = det.check(StepRecord(step, np.zeros((0, 6)), {"loss": x}))
        out += [step for kind, _, _ in events if kind == "loss_spike"]
    return out


def server_spikes(loss: np.ndarray) -> list[int]:
    det = LossSpikeDetector(DetectorConfig())
    return [f.step for f in det.process(np.arange(1, len(loss) + 1), loss)]


def test_jump_on_a_falling_loss_is_one_event_at_its_step_on_both_sides():
    loss = falling_loss(80, seed=0, jump_at=40)
    assert client_spikes(loss) == [40]
    assert server_spikes(loss) == [40]


def test_client_and_service_agree_on_noise_and_on_spikes():
    for seed in range(20):
        jump = 25 + seed * 2 if seed % 2 else None
        loss = falling_loss(90, seed, jump_at=jump)
        client, server = client_spikes(loss), server_spikes(loss)
        assert client == server, seed
        assert client == ([jump] if jump else []), seed


def test_client_rule_reads_its_tuning():
    # a longer EMA span changes the baseline, and the client passes it to the shared rule
    det = Detector(DetectConfig(loss_ema_span=3))
    assert det.loss_rule.params.ema_span == 3
