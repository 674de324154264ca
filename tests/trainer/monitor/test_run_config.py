"""A run's config as training scripts pass it (an HF model config with integer keys, numpy and torch scalars,
dataclasses, enums, paths) reaches a real `fp8-monitor serve` as JSON; a value with no JSON form is refused
at ``Monitor()`` with where it sits; and a sender thread that fails anyway keeps what it held in the spool and
says so, instead of stopping the run's telemetry in silence."""

from __future__ import annotations

import dataclasses
import enum
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from fp8_protocol.spool import read_spool
from fp8_trainer import Monitor
from fp8_trainer.monitor.config import jsonable_config
from fp8_trainer.monitor.sender import Sender
from tests.trainer.monitor_utils import FAST, get, tiny_model, train


class Mode(enum.Enum):
    FAST = "fast"


@dataclasses.dataclass
class Optim:
    lr: float = 3e-4
    betas: tuple = (0.9, 0.95)


def test_an_hf_model_config_and_friends_are_stored_as_json(server, tmp_path):
    transformers = pytest.importorskip("transformers")
    llama = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, vocab_size=256)  # fmt: skip
    config = {
        "model": llama.to_dict(),  # id2label: integer keys, which stopped all telemetry before
        "model_object": llama,
        "optim": Optim(),
        "scale": np.float32(1.5),
        "steps": torch.tensor(40),
        "mode": Mode.FAST,
        "out": Path("runs/x"),
        3: "an integer key",
    }
    model, recipe = tiny_model()
    with Monitor(server.url, "hf-config", model, recipe, config=config, spool_path=tmp_path / "s.jsonl",
                 **FAST) as mon:  # fmt: skip
        train(model, recipe, mon, 3)
    stored = get(server.url, f"/runs/{mon.run_id}")
    assert stored["steps_stored"] == 3
    got = stored["config"]
    assert got["model"]["id2label"] == {"0": "LABEL_0", "1": "LABEL_1"}
    assert got["model_object"]["hidden_size"] == 64 and got["model_object"]["id2label"]["1"] == "LABEL_1"
    assert got["optim"] == {"lr": 3e-4, "betas": [0.9, 0.95]}
    assert (got["scale"], got["steps"], got["mode"], got["out"], got["3"]) == (
        1.5, 40, "fast", "runs/x", "an integer key"
    )  # fmt: skip
    assert not (tmp_path / "s.jsonl").exists()


@pytest.mark.parametrize(
    ("config", "where"),
    [
        ({"model": {"init": object()}}, "config['model']['init']: builtins.object has no JSON form"),
        ({"layers": [1, lambda x: x]}, "config['layers'][1]: builtins.function has no JSON form"),
        ({1: "a", "1": "b"}, "keys '1' and '1' both read '1'"),
        ([1, 2], "config: expected a mapping"),
    ],
)
def test_a_config_without_a_json_form_is_refused_at_monitor_with_where(config, where, tmp_path):
    model, recipe = tiny_model()
    with pytest.raises(ValueError) as e:
        Monitor("http://127.0.0.1:9", "bad-config", model, recipe, config=config, spool_path=tmp_path / "s")
    assert where in str(e.value)
    assert not (tmp_path / "s").exists()


def test_jsonable_config_keeps_what_json_has_and_spells_what_it_lacks():
    assert jsonable_config({"a": [1, 2.5, None, True], "nan": float("nan"), (True): 1}) == {
        "a": [1, 2.5, None, True], "nan": "nan", "true": 1
    }  # fmt: skip
    assert jsonable_config(None) == {}


def test_a_failing_sender_keeps_what_it_held_in_the_spool_and_says_so(server, tmp_path, monkeypatch, caplog):
    real = Sender._make_batch
    calls = {"n": 0}

    def fails_on_the_second_batch(self, urgent):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("a bug in the sender")
        return real(self, urgent)

    monkeypatch.setattr(Sender, "_make_batch", fails_on_the_second_batch)
    model, recipe = tiny_model()
    spool = tmp_path / "s.jsonl"
    with caplog.at_level(logging.WARNING, logger="fp8scope"):
        mon = Monitor(server.url, "sender-bug", model, recipe, spool_path=spool, max_batch_steps=4, **FAST)
        train(model, recipe, mon, 12)  # the training loop never notices
        mon.close()
    assert mon.sender.failed
    message = next(r.getMessage() for r in caplog.records if "sender thread failed" in r.getMessage())
    assert f"fp8-monitor upload {spool}" in message
    kept = sorted(s["step"] for b in read_spool(spool).batches for s in b.get("steps", []))
    posted = get(server.url, f"/runs/{mon.run_id}")["steps_stored"]
    # what the thread held when it failed follows what was posted: nothing between lost, nothing twice (the
    # steps the loop makes after that are not queued any more: telemetry stops, as the message says)
    assert kept and kept == list(range(posted + 1, posted + 1 + len(kept)))
