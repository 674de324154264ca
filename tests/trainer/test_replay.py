"""Incident capture and replay on real tiny-preset runs on the CPU: a bundle replays its step bit for bit,
faults that are not FP8's get ``not-fp8``, an FP8 saturation gets ``fp8-caused`` with its tensor named."""

import json
import math

import pytest
import torch

from fp8_trainer.app import cli
from fp8_trainer.app.incident_capture import CaptureConfig, IncidentCapture, load_bundle
from fp8_trainer.app.inject import Injection, parse_injection
from fp8_trainer.app.replay import VERDICTS, replay
from fp8_trainer.app.train import train

FLAGS = ["--batch-size", "4", "--seq-len", "32", "--eval-interval", "0", "--no-progress"]
FLAGS += ["--lr-schedule", "constant", "--warmup-steps", "0", "--capture-every", "3"]
STEP = 40  # the failing step: the spike rule has 20 losses of history by then

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def counting(tmp_path_factory):
    """A corpus whose batches are alike (counting in decimal): the per-step loss is smooth, so a spike
    stands out, and predicting the next digit needs the context, so the layers matter."""
    path = tmp_path_factory.mktemp("data") / "count.txt"
    path.write_text(" ".join(str(i) for i in range(20000)))
    return str(path)


@pytest.fixture
def run(tmp_path, counting):
    def run(*extra: str, steps: int = STEP + 1):
        """Train with incident capture into ``tmp_path``; the result, printed lines and bundles written."""
        argv = ["--steps", str(steps), *FLAGS, "--data", counting, "--capture-dir", str(tmp_path), *extra]
        a, prepared = cli.prepare(argv)
        lines: list[str] = []
        result = train(a, prepared, out=lines.append)
        return result, lines, sorted(tmp_path.glob("incident-step*.pt"))

    return run


def test_a_nan_is_captured_and_replayed_bit_for_bit_and_is_not_fp8(run):
    result, lines, bundles = run("--inject", f"nan:blocks.2.attn.qkv@{STEP}")
    assert [b.name for b in bundles] == [f"incident-step{STEP}.pt"]  # the first non-finite step only
    assert any(f"incident bundle {bundles[0]}" in line for line in lines)
    bundle = load_bundle(bundles[0])
    assert bundle["trigger"]["kind"] == "nonfinite"
    # the window: from the older of two snapshots (taken every 3 steps) to the failing step
    assert [s["step"] for s in bundle["steps"]] == list(range(bundle["snapshot"]["step"] + 1, STEP + 1))
    assert 3 < len(bundle["steps"]) <= 6
    assert [s["loss"] for s in bundle["steps"][:-1]] == result.losses[STEP - len(bundle["steps"]) : STEP - 1]

    report = replay(bundles[0])
    json.dumps(report, allow_nan=False)  # JSON as it is, NaN spelled
    assert report["verdict"] == "not-fp8" and report["bitwise"]
    fp8, hp = report["configs"]
    assert fp8["loss"] == "NaN" and hp["loss"] == "NaN"

    out = bundles[0].with_suffix(".json")  # the same from the command line
    assert cli.main(["replay", str(bundles[0]), "--no-bisect", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["verdict"] == "not-fp8"
    assert cli.main(["replay", str(out)]) == 2  # not a bundle: a message, exit 2


def test_a_learning_rate_spike_is_not_fp8_and_the_replay_is_bitwise(run):
    result, _, bundles = run("--inject", f"lr-spike@{STEP - 1}x1000")
    assert [b.name for b in bundles] == [f"incident-step{STEP}.pt"]  # the loss spikes after the bad update
    bundle = load_bundle(bundles[0])
    assert bundle["trigger"]["kind"] == "loss_spike" and bundle["trigger"]["loss"] == result.losses[STEP - 1]
    assert any(s["lr"] == pytest.approx(1.0) for s in bundle["steps"])  # the spiked step is in the window

    report = replay(bundles[0])
    assert report["verdict"] == "not-fp8", report["reason"]
    fp8, hp = report["configs"]
    assert report["bitwise"] and fp8["loss"] == result.losses[STEP - 1]  # bit for bit, on the CPU
    assert hp["fault"] and hp["loss"] > 2 * bundle["trigger"]["expected"]


def test_an_fp8_saturation_is_fp8_caused_and_its_tensor_is_named_first(run):
    layer = "blocks.3.mlp.fc2"
    result, _, bundles = run("--inject", f"saturate:{layer}@{STEP}")
    assert [b.name for b in bundles] == [f"incident-step{STEP}.pt"]

    report = replay(bundles[0], bisect=True)
    assert report["verdict"] == "fp8-caused", report["reason"]
    assert report["culprits"][0] == f"{layer}.input"
    configs = {c["name"]: c for c in report["configs"]}
    assert report["bitwise"] and configs["fp8"]["loss"] == result.losses[STEP - 1]
    assert not configs["high-precision"]["fault"]
    # the evidence: that layer alone in high precision removes the fault, no other layer does
    singles = {n.removeprefix("layer "): c for n, c in configs.items() if n.startswith("layer ")}
    assert len(singles) == 16 and [n for n, c in singles.items() if not c["fault"]] == [layer]
    assert configs[f"emulated {layer}"]["fault"]  # every cast emulated: the fault is still there
    assert configs[f"cast {layer}.weight"]["fault"] and configs[f"cast {layer}.grad_output"]["fault"]
    assert not configs[f"cast {layer}.input"]["fault"]
    # its output, against high precision: far below the other layers' in the FP8 replay
    sqnr = configs["fp8"]["sqnr_db"]
    others = [v for n, v in sqnr.items() if n != layer]
    assert sqnr[layer] < 0 < 15 < min(others), sqnr
    assert report["verdict"] in VERDICTS and report["window"] == [bundle_start(bundles[0]), STEP]


@pytest.mark.parametrize(
    "fault,culprit,seed",
    # lowprec with seed 3: with the default seed its step-40 loss scores z 5.7 on some CPUs (the matmul
    # kernels differ), under the rule's 6, and the gradient trigger writes the step's bundle instead;
    # with seed 3 it scores 10.7 (and jump 18.8 with the default)
    [("jump", "{layer}.input", "0"), ("lowprec", "{layer}.input+{layer}.weight", "3")],
)
def test_a_stale_scale_jump_and_an_sqnr_collapse_are_fp8_caused_with_their_tensors_named(
    run, fault, culprit, seed
):
    """jump: the input x16 from STEP on saturates against the stale history at STEP only; lowprec: the
    input's range beyond E4M3's from STEP on. Both spike the FP8 loss at STEP, the replay says fp8-caused
    and names the layer's casts (lowprec's undo amplifies the weight's rounding as much as the input's, so
    only the pair in high precision removes it)."""
    layer = "blocks.3.mlp.fc2"
    result, _, bundles = run("--inject", f"{fault}:{layer}@{STEP}", "--seed", seed, steps=STEP + 2)
    assert bundles[0].name == f"incident-step{STEP}.pt"
    bundle = load_bundle(bundles[0])
    assert [bool(s["injections"]) for s in bundle["steps"]] == [s["step"] >= STEP for s in bundle["steps"]]
    expected = bundle["trigger"]["expected"]
    assert result.losses[STEP - 1] > 2 * expected
    if fault == "jump":  # the history has seen the jump: the next step trains on
        assert result.losses[STEP] < expected + 0.5 * (result.losses[STEP - 1] - expected)

    report = replay(bundles[0])
    assert report["verdict"] == "fp8-caused", report["reason"]
    assert report["culprits"][0] == culprit.format(layer=layer)
    configs = {c["name"]: c for c in report["configs"]}
    assert report["bitwise"] and not configs["high-precision"]["fault"]
    singles = {n.removeprefix("layer "): c for n, c in configs.items() if n.startswith("layer ")}
    assert [n for n, c in singles.items() if not c["fault"]] == [layer]
    sqnr = configs["fp8"]["sqnr_db"]
    assert sqnr[layer] < 0 < 15 < min(v for n, v in sqnr.items() if n != layer), sqnr


def test_the_float32_twins_train_through_a_jump_and_an_sqnr_collapse(run):
    """Undone in high precision up to rounding: no incident, and the losses of a run without the fault."""
    clean, _, _ = run("--recipe", "fp32", steps=STEP + 2)
    for fault in ("jump", "lowprec"):
        twin, _, bundles = run(
            "--recipe", "fp32", "--inject", f"{fault}:blocks.3.mlp.fc2@{STEP}", steps=STEP + 2
        )
        assert bundles == [] and twin.losses[: STEP - 1] == clean.losses[: STEP - 1]
        assert twin.losses[STEP - 1 :] == pytest.approx(clean.losses[STEP - 1 :], rel=1e-4), fault


def test_a_fault_from_outside_the_bundle_is_not_reproducible(run, tmp_path):
    _, _, bundles = run("--inject", f"saturate:blocks.3.mlp.fc2@{STEP}", steps=STEP)
    bundle = load_bundle(bundles[0])
    for record in bundle["steps"]:
        record["injections"] = []  # as if the fault had come from outside what was captured
    torch.save(bundle, tmp_path / "edited.pt")
    report = replay(tmp_path / "edited.pt")
    assert report["verdict"] == "not-reproducible" and not report["bitwise"]
    assert "non-determinism, or a fault from outside the captured state" in report["reason"]

    bundle["steps"][-1]["batches"] = []  # and a bundle that lost the failing step's batch
    torch.save(bundle, tmp_path / "broken.pt")
    report = replay(tmp_path / "broken.pt")
    assert report["verdict"] == "not-reproducible" and report["reason"].startswith("missing state")


def bundle_start(path) -> int:
    return load_bundle(path)["snapshot"]["step"] + 1


def test_the_twin_in_high_precision_trains_through_the_saturation(run):
    """The injected saturation is FP8's alone: a float32 run with it has no incident."""
    assert parse_injection("saturate:blocks.3.mlp.fc2@7") == Injection(
        "saturate", 7, "blocks.3.mlp.fc2", 4096.0
    )
    result, _, bundles = run("--recipe", "fp32", "--inject", f"saturate:blocks.3.mlp.fc2@{STEP}")
    assert bundles == [] and all(math.isfinite(v) for v in result.losses)


def test_capture_is_bounded(tmp_path):
    """Nothing is written past the size cap, and the bundle is about a checkpoint's size."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters())
    cap = IncidentCapture(CaptureConfig(str(tmp_path), every=2, max_bytes=1), model, opt, {"preset": "x"})
    cap.begin(1, 1e-3)
    assert cap.end(1, torch.tensor(float("nan"))) is None  # over the 1-byte cap
    assert cap.skipped and list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="every"):
        CaptureConfig(str(tmp_path), every=0)
