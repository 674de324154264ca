"""Non-finite detector: the first tensor in forward-then-backward order, the step, episodes, the loss."""

from __future__ import annotations

import numpy as np

from monitor_server.detectors.nonfinite import forward_backward_order
from tests.server.detectors.runs import healthy_run, index_of, keys, of_kind, run_engine


def test_forward_backward_order_runs_backward_last_layer_first():
    run = healthy_run(10, n_layers=3)
    names = [run.tensors[i].name for i in forward_backward_order(run.tensors)]
    assert names == [
        "blocks.0.fc.input", "blocks.0.fc.weight",
        "blocks.1.fc.input", "blocks.1.fc.weight",
        "blocks.2.fc.input", "blocks.2.fc.weight",
        "blocks.2.fc.grad_output", "blocks.1.fc.grad_output", "blocks.0.fc.grad_output",
    ]  # fmt: skip


def test_later_layers_grad_output_is_first_in_backward():
    run = healthy_run(200, n_layers=4)
    g0, g2 = index_of(run.tensors, 0, "grad_output"), index_of(run.tensors, 2, "grad_output")
    run.stats["nonfinite"][120, [g0, g2]] = 7
    found = of_kind(run_engine(run, cuts=[100]), "nonfinite")
    assert keys(found) == [("nonfinite", g2, 120, "critical"), ("nonfinite", g0, 120, "critical")]
    first, second = found
    assert first.evidence["first_in_run"] is True and second.evidence["first_in_run"] is False
    assert "first" in first.message and "blocks.2.fc.grad_output" in first.message and "120" in first.message
    assert [a["name"] for a in first.evidence["affected_in_order"]] == [
        "blocks.2.fc.grad_output",
        "blocks.0.fc.grad_output",
    ]
    assert second.evidence["run_first"] == {
        "step": 120,
        "tensor_index": g2,
        "name": "blocks.2.fc.grad_output",
    }


def test_forward_input_beats_every_grad_output_at_the_same_step():
    run = healthy_run(200, n_layers=4)
    g0, g2 = index_of(run.tensors, 0, "grad_output"), index_of(run.tensors, 2, "grad_output")
    i3 = index_of(run.tensors, 3, "input")
    run.stats["nonfinite"][150, [g0, g2]] = 1
    run.stats["amax"][150, i3] = np.nan  # a NaN amax with a zero count is non-finite too
    found = of_kind(run_engine(run), "nonfinite")
    assert [f.tensor_index for f in found] == [i3, g2, g0]
    assert found[0].evidence["first_in_run"] and found[0].step == 150
    assert found[0].evidence["amax"] == "NaN"


def test_input_before_weight_within_a_layer_and_inf_amax():
    run = healthy_run(60, n_layers=2)
    i1, w1, w0 = (index_of(run.tensors, 1, "input"), index_of(run.tensors, 1, "weight"),
                  index_of(run.tensors, 0, "weight"))  # fmt: skip
    run.stats["amax"][30, w1] = np.inf
    run.stats["nonfinite"][30, i1] = 3
    run.stats["nonfinite"][30, w0] = 3
    assert [f.tensor_index for f in run_engine(run)] == [w0, i1, w1]


def test_first_step_wins_over_order_and_episodes_fire_once():
    run = healthy_run(300, n_layers=4)
    g0, i3 = index_of(run.tensors, 0, "grad_output"), index_of(run.tensors, 3, "input")
    run.stats["nonfinite"][100:110, g0] = 5  # one episode of 10 steps
    run.stats["nonfinite"][105:108, i3] = 5  # later, though earlier in forward-backward order
    run.stats["nonfinite"][200, g0] = 1  # a second episode of g0
    found = run_engine(run, cuts=[103, 104, 150])
    assert keys(found) == [
        ("nonfinite", g0, 100, "critical"),
        ("nonfinite", i3, 105, "critical"),
        ("nonfinite", g0, 200, "critical"),
    ]
    assert found[0].evidence["first_in_run"]
    assert not found[1].evidence["first_in_run"] and found[1].evidence["first_at_step"]
    assert found[2].evidence["run_first"]["step"] == 100


def test_nan_loss_sits_between_forward_and_backward():
    run = healthy_run(100, n_layers=2)
    run.loss_present = np.ones(100, dtype=bool)
    g1, w1 = index_of(run.tensors, 1, "grad_output"), index_of(run.tensors, 1, "weight")
    run.loss[40] = np.nan
    run.stats["nonfinite"][40, [g1, w1]] = 2
    found = run_engine(run)
    assert keys(found) == [
        ("nonfinite", w1, 40, "critical"),
        ("nonfinite", None, 40, "critical"),
        ("nonfinite", g1, 40, "critical"),
    ]
    assert [a["name"] for a in found[0].evidence["affected_in_order"]] == [
        "blocks.1.fc.weight",
        "loss",
        "blocks.1.fc.grad_output",
    ]


def test_nan_loss_is_missing_without_presence_but_inf_loss_counts():
    run = healthy_run(100, n_layers=2)
    run.loss[40] = np.nan  # no `present` mask: a step without a loss
    run.loss[60] = np.inf
    assert keys(run_engine(run)) == [("nonfinite", None, 60, "critical")]


def test_loss_only_nonfinite_is_run_level_and_first():
    run = healthy_run(100, n_layers=2)
    run.loss_present = np.ones(100, dtype=bool)
    run.loss[70:75] = np.nan
    found = run_engine(run, cuts=[72])
    assert keys(found) == [("nonfinite", None, 70, "critical")]
    assert found[0].evidence["first_in_run"] and "loss" in found[0].message


def test_healthy_run_has_no_nonfinite():
    assert of_kind(run_engine(healthy_run(300, n_layers=4), cuts=[50, 51, 200]), "nonfinite") == []
