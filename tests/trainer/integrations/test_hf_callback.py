"""``Fp8ScopeCallback`` in a real Hugging Face ``Trainer`` (tiny Llama, CPU) streaming into a real
`fp8-monitor serve`: every optimizer step stored once, with the statistics the runtime computed at that
step and the loss the Trainer reports for it, under gradient accumulation; in FP8 and in shadow mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from transformers import Trainer, TrainingArguments

import fp8_trainer
from fp8_trainer import DelayedScaling, Linear, tensor_table
from fp8_trainer.integrations.hf import Fp8ScopeCallback
from tests.trainer.integrations.llama import BATCH, SEQ, Seen, Tokens, tiny_llama
from tests.trainer.monitor_utils import FAST, get, stored_stats

STEPS, ACCUM = 4, 2


def run(tmp_path, callback=None, **training_args):
    model = tiny_llama()
    training_args = {"logging_steps": 1, "run_name": "hf-tiny", **training_args}
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH,
                             gradient_accumulation_steps=ACCUM, max_steps=STEPS, learning_rate=1e-3,
                             save_strategy="no", report_to=[], use_cpu=True,
                             disable_tqdm=True, seed=0, **training_args)  # fmt: skip
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
    # the grad norm the Trainer logs at each logging step (logging_steps=1: every step)
    grad = get(url, f"/runs/{run_id}/series", name="grad_norm")
    assert grad["steps"] == list(range(1, STEPS + 1))
    assert grad["values"] == [seen.grad_norms[s] for s in range(1, STEPS + 1)]
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


def test_every_step_is_stored_and_the_logging_steps_carry_the_trainers_grad_norm(server, tmp_path):
    keep = lambda m, fqn: fqn != "lm_head"  # noqa: E731
    cb = Fp8ScopeCallback(server.url, recipe=DelayedScaling(), module_filter_fn=keep,
                          spool_path=tmp_path / "s.jsonl", **FAST)  # fmt: skip
    _, seen = run(tmp_path, cb, logging_steps=2, max_grad_norm=0.5, run_name="hf-log2")
    run_id = next(r["id"] for r in get(server.url, "/runs") if r["name"] == "hf-log2")
    assert get(server.url, f"/runs/{run_id}/series", name="loss")["steps"] == list(range(1, STEPS + 1))
    grad = get(server.url, f"/runs/{run_id}/series", name="grad_norm")
    assert grad["steps"] == [2, 4] == sorted(seen.grad_norms)
    assert grad["values"] == [seen.grad_norms[2], seen.grad_norms[4]]
    assert max(grad["values"]) > 0.5  # the norm before clipping, as the Trainer logs it


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


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=SEQ))


def _train_gpt2(tmp_path, model, callback):
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH,
                             max_steps=STEPS, learning_rate=1e-3, logging_steps=1, save_strategy="no",
                             report_to=[], use_cpu=True, disable_tqdm=True, seed=0)  # fmt: skip
    Trainer(model=model, args=args, train_dataset=Tokens(BATCH * STEPS), callbacks=[callback]).train()


def test_gpt2_trains_its_conv1d_layers_in_fp8_and_the_run_says_what_was_left_out(server, tmp_path):
    # the README's filter leaves lm_head out by name; GPT-2's eight Conv1D layers train in FP8
    model = _gpt2()
    cb = Fp8ScopeCallback(server.url, run_name="gpt2-fp8", recipe=DelayedScaling(),
                          module_filter_fn=lambda m, name: name != "lm_head", spool_path=tmp_path / "s.jsonl",
                          **FAST)  # fmt: skip
    _train_gpt2(tmp_path, model, cb)
    conv = [name for name, m in model.named_modules() if isinstance(m, fp8_trainer.Conv1D)]
    assert len(conv) == 8 and "transformer.h.1.mlp.c_fc" in conv
    run = next(r for r in get(server.url, "/runs") if r["name"] == "gpt2-fp8")
    tensors = [t["name"] for t in get(server.url, f"/runs/{run['id']}/tensors")]
    assert len(tensors) == 24 and "transformer.h.0.attn.c_attn.input" in tensors
    stats = stored_stats(server.url, run["id"])
    assert stats["amax"].shape == (24, STEPS) and (stats["amax"] > 0).all()
    assert "fp8_left_out" not in get(server.url, f"/runs/{run['id']}")["config"]  # left out by the filter


def test_a_model_with_nothing_to_convert_says_why(server, tmp_path):
    model = _gpt2()
    cb = Fp8ScopeCallback(server.url, run_name="gpt2-none", recipe=DelayedScaling(),
                          module_filter_fn=lambda m, name: False,
                          spool_path=tmp_path / "s.jsonl", **FAST)  # fmt: skip
    with pytest.raises(ValueError, match="convert_to_fp8 found no layer of GPT2LMHeadModel to run in FP8"):
        _train_gpt2(tmp_path, model, cb)


def test_layers_left_out_of_fp8_are_in_the_run_config_with_their_reason(server, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=60, n_positions=SEQ))
    cb = Fp8ScopeCallback(server.url, run_name="gpt2-left", recipe=DelayedScaling(),
                          spool_path=tmp_path / "s.jsonl", **FAST)  # fmt: skip
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH, max_steps=2,
                             save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)  # fmt: skip
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 60, (2 * BATCH, SEQ))]
    Trainer(model=model, args=args, train_dataset=data, callbacks=[cb]).train()
    run = next(r for r in get(server.url, "/runs") if r["name"] == "gpt2-left")
    left = get(server.url, f"/runs/{run['id']}")["config"]["fp8_left_out"]
    assert left == {"lm_head": "in_features=32, out_features=60: not multiples of 16"}
