"""A gradient fault on real tiny-preset runs on the CPU: a saturated E5M2 grad_output (``gradspike``) does
not move the loss, so the capture triggers on the step's statistics (``grad_overflow``) and the replay judges
the layer's gradients: fp8-caused, with ``LAYER.grad_output`` named first. A gradient blow-up in any
precision (``gradblowup``) saturates the same cast and is not-fp8; clean runs write no bundle."""

import math

import pytest

from fp8_trainer.app import cli
from fp8_trainer.app.incident_capture import CaptureConfig, load_bundle
from fp8_trainer.app.inject import Injection, parse_injection
from fp8_trainer.app.replay import replay
from fp8_trainer.app.replay_judge import GRAD_BLOWUP, GRAD_FAULT_DB, GradJudge, LossJudge, judge_for
from fp8_trainer.app.train import train
from tests.trainer.test_replay import FLAGS, STEP

pytestmark = pytest.mark.usefixtures("one_thread")
LAYER = "blocks.3.mlp.fc2"


@pytest.fixture(scope="module")
def counting(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "count.txt"
    path.write_text(" ".join(str(i) for i in range(20000)))
    return str(path)


@pytest.fixture
def run(tmp_path, counting):
    def run(*extra: str, steps: int = STEP + 1):
        argv = ["--steps", str(steps), *FLAGS, "--data", counting, "--capture-dir", str(tmp_path), *extra]
        a, prepared = cli.prepare(argv)
        result = train(a, prepared, out=lambda line: None)
        return result, sorted(tmp_path.glob("incident-step*.pt"))

    return run


def test_a_saturated_gradient_is_captured_by_its_statistics_and_is_fp8_caused(run):
    result, bundles = run("--inject", f"gradspike:{LAYER}@{STEP}")
    assert [b.name for b in bundles] == [f"incident-step{STEP}.pt"]
    trigger = load_bundle(bundles[0])["trigger"]
    assert trigger["kind"] == "grad_overflow" and trigger["tensor"] == f"{LAYER}.grad_output"
    assert trigger["fraction"] > 0.99 and trigger["bar"] == CaptureConfig(".").grad_overflow_frac
    # the loss's score rides along (not a spike): the replay judges the loss only where it is FP8's
    assert trigger["loss"] == result.losses[STEP - 1] and trigger["z"] < trigger["z_threshold"]

    report = replay(bundles[0])
    assert report["verdict"] == "fp8-caused", report["reason"]
    assert report["culprits"][0] == f"{LAYER}.grad_output" and f"{LAYER}'s gradients" in report["reason"]
    configs = {c["name"]: c for c in report["configs"]}
    fp8, hp = configs["fp8"], configs["high-precision"]
    assert report["bitwise"] and fp8["loss"] == result.losses[STEP - 1]
    assert fp8["loss"] == pytest.approx(hp["loss"], rel=1e-3)  # the loss did not move: 2.1452 against 2.1451
    # FP8's gradients of the layer: FACTOR times too small, about 0 dB against high precision's
    assert fp8["fault"] and abs(fp8["layer_grad_sqnr_db"]) < 1
    assert not hp["fault"] and hp["layer_grad_sqnr_db"] == "Infinity" and hp["layer_grad_ratio"] < GRAD_BLOWUP
    # only that layer in high precision removes the fault; of its casts, only grad_output
    singles = {n.removeprefix("layer "): c for n, c in configs.items() if n.startswith("layer ")}
    assert len(singles) == 16 and [n for n, c in singles.items() if not c["fault"]] == [LAYER]
    assert configs[f"emulated {LAYER}"]["fault"]
    assert configs[f"cast {LAYER}.input"]["fault"] and configs[f"cast {LAYER}.weight"]["fault"]
    fixed = configs[f"cast {LAYER}.grad_output"]
    assert not fixed["fault"] and fixed["layer_grad_sqnr_db"] > GRAD_FAULT_DB


def test_a_gradient_blow_up_in_any_precision_is_not_fp8(run):
    """grad_output x2**20, never undone: FP8 saturates it (far from high precision's gradients), but the
    high-precision run's gradients blew up too, so it is not FP8's fault."""
    assert parse_injection(f"gradblowup:{LAYER}@7") == Injection("gradblowup", 7, LAYER, 2.0**20)
    _, bundles = run("--inject", f"gradblowup:{LAYER}@{STEP}")
    assert [b.name for b in bundles] == [f"incident-step{STEP}.pt"]
    assert load_bundle(bundles[0])["trigger"]["tensor"] == f"{LAYER}.grad_output"

    report = replay(bundles[0])
    assert report["verdict"] == "not-fp8", report["reason"] and report["culprits"] == []
    fp8, hp = report["configs"]
    assert fp8["fault"] and fp8["layer_grad_sqnr_db"] < GRAD_FAULT_DB  # far from high precision's ...
    assert hp["fault"] and hp["layer_grad_ratio"] > 1e5  # ... which blew up, about 2**20 times


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_a_clean_run_with_capture_writes_no_bundle(run, recipe):
    result, bundles = run("--recipe", recipe, steps=2 * STEP)
    assert bundles == [] and all(math.isfinite(v) for v in result.losses)


def test_a_saturated_gradient_whose_loss_is_fp8s_is_judged_by_its_loss():
    """A grad_overflow bundle whose step's loss also rose, though under the spike rule's bar (lowprec's on
    some CPUs: z 5.7): judged by the loss when the FP8 replay has the loss fault and high precision has
    not, so the bisection names the casts; by the gradients when the loss moved in both or in neither."""
    trigger = {"kind": "grad_overflow", "tensor": f"{LAYER}.grad_output", "loss": 4.71, "expected": 2.2}
    trigger.update(sigma=0.44, z=5.7, z_threshold=6.0)  # the verdict bar: 2.2 + max(1.255, 1.32) = 3.52

    def window(last):
        return {"losses": [2.3, 2.25, last]}

    judge = judge_for(trigger, window(4.71), window(2.2))
    assert isinstance(judge, LossJudge) and judge.bar == pytest.approx(3.52)
    assert isinstance(judge_for(trigger, window(4.71), window(4.6)), GradJudge)  # in high precision too
    assert isinstance(judge_for(trigger, window(2.3), window(2.2)), GradJudge)  # gradspike: no loss moved
    assert isinstance(judge_for({**trigger, "expected": None}, window(4.71), window(2.2)), GradJudge)
    assert isinstance(judge_for(trigger), GradJudge)  # no replay to tell yet
