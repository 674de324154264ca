"""Benchmark: how often ``torch.compile`` recompiles a model converted to FP8, against the same model in bf16.

Each FP8 ``Linear`` is a graph break (README, "torch.compile"): the code between breaks is compiled as frames
of its own, and frames whose guards change between calls are compiled again, up to Dynamo's recompile limit,
after which they run eagerly. This counts Dynamo's recompilations (``torch._dynamo.utils.counters``) over a
few training steps of

* ``gpt``   - the GPT of ``fp8_trainer.app.model`` (tiny preset), the model the README's claim was tested on;
* ``llama`` - a small Hugging Face ``LlamaForCausalLM`` (transformers installed),

each in FP8 (delayed scaling, ``lm_head`` left in high precision) and in plain precision, with training steps
alone and with an evaluation (``eval()``, ``no_grad``) after every other step.

    .venv/bin/python bench/recompiles.py [--steps 6]

Prints a table (recompilations, and whether a frame hit the limit) and writes bench/results/recompiles.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fp8_trainer import DelayedScaling, convert_to_fp8, fp8_autocast  # noqa: E402
from fp8_trainer.app.model import GPT, PRESETS, fp8_filter  # noqa: E402


def _gpt():
    model = GPT(PRESETS["tiny"])
    return model, fp8_filter, lambda m, ids: m(ids, ids)[1]


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256
    )
    return (
        LlamaForCausalLM(config),
        (lambda m, name: name != "lm_head"),
        lambda m, ids: m(ids, labels=ids).loss,
    )


MODELS = {"gpt": _gpt, "llama": _llama}


class _Said(logging.Handler):
    """Counts Dynamo's log lines that say a frame is compiled again, or hit the recompile limit."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.recompiles = 0
        self.limit_hits = 0

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        self.recompiles += "Recompiling function" in text
        self.limit_hits += "recompile_limit" in text and ("hit" in text or "reached" in text)


def count(model_name: str, fp8: bool, evaluate: bool, steps: int) -> dict:
    """Recompilations over ``steps`` training steps of one configuration, in a fresh Dynamo cache."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    said = _Said()
    dynamo_log = logging.getLogger("torch._dynamo")
    dynamo_log.addHandler(said)
    torch.manual_seed(0)
    model, module_filter, loss_of = MODELS[model_name]()
    recipe = DelayedScaling()
    if fp8:
        convert_to_fp8(model, recipe=recipe, module_filter_fn=module_filter)
    compiled = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    for step in range(steps):
        with fp8_autocast(enabled=fp8, fp8_recipe=recipe):
            loss = loss_of(compiled, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if evaluate and step % 2 == 1:
            model.eval()
            with torch.no_grad(), fp8_autocast(enabled=fp8, fp8_recipe=recipe):
                loss_of(compiled, ids)
            model.train()
    dynamo_log.removeHandler(said)
    return {
        "model": model_name,
        "fp8": fp8,
        "evaluate": evaluate,
        "unique_graphs": counters["stats"].get("unique_graphs", 0),
        "recompiles": said.recompiles,
        "recompile_limit_hits": said.limit_hits,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--models", default="gpt,llama")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "recompiles.json"))
    a = p.parse_args()
    torch._logging.set_logs(recompiles=True)  # Dynamo says each recompilation: counted, not shown
    logging.getLogger("torch._dynamo").propagate = False
    for name in ["torch", *logging.root.manager.loggerDict]:
        if name.startswith("torch") and isinstance(logger := logging.getLogger(name), logging.Logger):
            for handler in list(logger.handlers):
                logger.removeHandler(handler)
    rows = []
    for model_name in a.models.split(","):
        for fp8 in (True, False):
            for evaluate in (False, True):
                rows.append(count(model_name, fp8, evaluate, a.steps))
    print(f"{'model':8} {'precision':10} {'loop':14} {'graphs':>7} {'recompiles':>11} {'limit hits':>11}")
    for r in rows:
        loop = "train + eval" if r["evaluate"] else "train"
        print(
            f"{r['model']:8} {'fp8' if r['fp8'] else 'plain':10} {loop:14} {r['unique_graphs']:>7} "
            f"{r['recompiles']:>11} {r['recompile_limit_hits']:>11}"
        )
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        pass
    out.write_text(json.dumps({"env": env, "steps": a.steps, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
