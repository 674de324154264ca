"""``Fp8ScopeCallback`` in a real Hugging Face ``Trainer`` (tiny Llama, CPU) streaming into a real
`fp8-monitor serve`: every optimizer step stored once, with the statistics the runtime computed at that
step and the loss the Trainer reports for it, under gradient accumulation; in FP8 and in shadow mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from transformers import Trainer, TrainingArguments

from fp8_trainer import DelayedScaling, Linear, tensor_table
from fp8_trainer.integrations.hf import Fp8ScopeCallback
from tests.trainer.integrations.llama import BATCH, SEQ, Seen, Tokens, tiny_llama
from tests.trainer.monitor_utils import FAST, get, stored_stats

STEPS, ACCUM = 4, 2


def run(tmp_path, callback=None, **training_args):
    model = tiny_llama()
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH,
                             gradient_accumulation_steps=ACCUM, max_steps=STEPS, learning_rate=1e-3,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             disable_tqdm=True, seed=0, run_name="hf-tiny", **training_args)  # fmt: skip
    seen = Seen(model)
    callbacks = [callback, seen] if callback is not None else [seen]
    trainer = Trainer(
        model=model, args=args, train_dataset=Tokens(BATCH * ACCUM * STEPS), callbacks=callbacks
    )
    trainer.train()
    return model, seen


def assert_stored(url, run_id, seen, fp8: bool):
    run = get(url, f"/runs/{run_id}")
    assert run["steps_stored"] == STEPS and (run["first_step"], run["last_step"]) == (1, STEPS)
    assert run["status"] == "finished"
    assert run["config"]["gradient_accumulation_steps"] == ACCUM and run["config"]["learning_rate"] == 1e-3
    # the model's own config too (a PretrainedConfig, with integer keys in id2label)
    assert run["config"]["model_config"]["hidden_size"] == 32
    assert run["config"]["model_config"]["id2label"] == {"0": "LABEL_0", "1": "LABEL_1"}
    series = get(url, f"/runs/{run_id}/series", name="loss")
    assert series["steps"] == list(range(1, STEPS + 1))
    assert series["values"] == [seen.losses[s] for s in range(1, STEPS + 1)]  # the Trainer's own loss
    lr = get(url, f"/runs/{run_id}/series", name="lr")["values"]
    assert lr[0] == 1e-3 and lr[-1] < lr[0]  # the rate each step used (linear decay)
    if not fp8:
        return
    got = stored_stats(url, run_id)
    for c, metric in enumerate(("amax", "scale", "overflow", "underflow", "nonfinite")):
        want = np.stack([seen.stats[s][:, c] for s in range(1, STEPS + 1)], axis=1)
        np.testing.assert_array_equal(got[metric], want, err_msg=metric)
    # one FP8 step per optimizer step: the input's numel counts both micro-batches
    assert seen.stats[1][0, 5] == ACCUM * BATCH * SEQ * 32


def test_trainer_in_fp8(server, tmp_path):
    cb = Fp8ScopeCallback(server.url, recipe=DelayedScaling(amax_history_len=4),
                          module_filter_fn=lambda m, fqn: fqn != "lm_head", spool_path=tmp_path / "s.jsonl",
                          **FAST)  # fmt: skip
    model, seen = run(tmp_path, cb)
    assert sum(isinstance(m, Linear) for m in model.modules()) == 14  # 7 per decoder layer
    assert "forward" not in model.__dict__  # the forward wrapper is gone after training
    run_id = next(r["id"] for r in get(server.url, "/runs") if r["name"] == "hf-tiny")  # TrainingArguments
    assert_stored(server.url, run_id, seen, fp8=True)
    assert len(get(server.url, f"/runs/{run_id}/tensors")) == len(tensor_table(model)) == 42
    assert seen.stats[STEPS][:, 1].min() != 1.0  # the delayed scales moved: the FP8 region was active


def test_trainer_in_shadow_mode_keeps_the_numerics(server, tmp_path):
    plain, plain_seen = run(tmp_path / "plain")
    cb = Fp8ScopeCallback(server.url, run_name="hf-shadow", shadow=DelayedScaling(),
                          spool_path=tmp_path / "s.jsonl", **FAST)  # fmt: skip
    model, seen = run(tmp_path / "shadow", cb)
    assert seen.losses == plain_seen.losses  # bit for bit the same training
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p, q)
    run_id = next(r["id"] for r in get(server.url, "/runs") if r["name"] == "hf-shadow")
    assert get(server.url, f"/runs/{run_id}")["config"]["fp8_source"] == "shadow"
    assert_stored(server.url, run_id, seen, fp8=True)
    assert len(tensor_table(model)) == 45  # every nn.Linear, lm_head included


def test_trainer_with_a_torchao_model(server, tmp_path):
    """A model converted by torchao before the Trainer is made: the callback needs no recipe; the statistics
    are torchao's, one step per optimizer step under gradient accumulation."""
    ao = pytest.importorskip("torchao.float8")
    model = tiny_llama()
    config = ao.Float8LinearConfig(emulate=True)
    ao.convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn != "lm_head")
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH,
                             gradient_accumulation_steps=ACCUM, max_steps=STEPS, learning_rate=1e-3,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             disable_tqdm=True, seed=0, run_name="hf-torchao")  # fmt: skip
    seen = Seen(model)
    cb = Fp8ScopeCallback(server.url, spool_path=tmp_path / "s.jsonl", **FAST)
    Trainer(model=model, args=args, train_dataset=Tokens(BATCH * ACCUM * STEPS), callbacks=[cb, seen]).train()
    run_id = next(r["id"] for r in get(server.url, "/runs") if r["name"] == "hf-torchao")
    assert get(server.url, f"/runs/{run_id}")["config"]["fp8_source"] == "torchao"
    assert_stored(server.url, run_id, seen, fp8=True)


def test_evaluations_reach_the_run_as_eval_events(server, tmp_path):
    """Evaluations every 2 steps: each is an `eval` event at its step with the Trainer's own numbers
    (eval_loss as val_loss), as the run page charts fp8-train's."""
    cb = Fp8ScopeCallback(server.url, run_name="hf-evals", recipe=DelayedScaling(),
                          spool_path=tmp_path / "s.jsonl", module_filter_fn=lambda m, fqn: fqn != "lm_head",
                          **FAST)  # fmt: skip
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH,
                             per_device_eval_batch_size=BATCH, max_steps=STEPS, eval_strategy="steps",
                             eval_steps=2, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                             seed=0)  # fmt: skip
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=Tokens(BATCH * STEPS),
                      eval_dataset=Tokens(2 * BATCH), callbacks=[cb])  # fmt: skip
    trainer.train()
    logged = [e for e in trainer.state.log_history if "eval_loss" in e]
    assert [e["step"] for e in logged] == [2, 4]
    run_id = next(r["id"] for r in get(server.url, "/runs") if r["name"] == "hf-evals")
    events = get(server.url, f"/runs/{run_id}/events", kind="custom")
    assert [(e["step"], e["details"]["name"]) for e in events] == [(2, "eval"), (4, "eval")]
    for event, want in zip(events, logged, strict=True):
        assert event["details"]["val_loss"] == want["eval_loss"]
        assert event["details"]["runtime"] == want["eval_runtime"]


def test_shadow_statistics_under_reentrant_gradient_checkpointing_are_those_without_it(server, tmp_path):
    # reentrant checkpointing runs each decoder layer's forward under no_grad and again inside backward;
    # with two micro-batches per step, both must be recorded once, as without checkpointing
    def shadowed(name, **training_args):
        cb = Fp8ScopeCallback(server.url, run_name=name, shadow=DelayedScaling(),
                              spool_path=tmp_path / f"{name}.jsonl", **FAST)  # fmt: skip
        return run(tmp_path / name, cb, **training_args)[1]

    plain = shadowed("hf-shadow-plain")
    # transformers 5 renamed gradient_checkpointing to activation_checkpointing (the old name warns)
    fields = TrainingArguments.__dataclass_fields__
    name = "activation" if "activation_checkpointing" in fields else "gradient"
    flags = {f"{name}_checkpointing": True, f"{name}_checkpointing_kwargs": {"use_reentrant": True}}
    ckpt = shadowed("hf-shadow-ckpt", **flags)
    assert ckpt.losses == plain.losses
    assert ckpt.stats[1][0, 5] == ACCUM * BATCH * SEQ * 32  # both micro-batches of the first step
    for s in range(1, STEPS + 1):
        np.testing.assert_array_equal(ckpt.stats[s], plain.stats[s], err_msg=f"step {s}")
