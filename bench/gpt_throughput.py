"""Training throughput (tokens/s) of the GPT "124m" preset: fp8scope delayed and current scaling against a
bf16 autocast baseline and torchao's tensorwise FP8 recipe, measured side by side in one run.

Every configuration trains its own copy of the same model (same seed) the way ``fp8-train`` does
(``fp8_trainer/app/train.py``): float32 master weights, AdamW (betas 0.9 / 0.95), gradient clipping at 1.0,
``zero_grad(set_to_none=True)``, one optimizer step per batch. All run under ``torch.autocast`` to bfloat16,
so attention, LayerNorm and the tied ``lm_head`` run in bf16 everywhere and the configurations differ only
in their block Linears:

* ``bf16``: ``nn.Linear`` under autocast (the ``--recipe bf16`` baseline);
* ``fp8scope delayed`` / ``fp8scope current``: ``convert_to_fp8(model, recipe, fp8_filter)`` and
  ``fp8_autocast``, with statistics on: every tensor's statistics are recorded in each step and read one
  step late through ``StatsReader.poll()``, as the monitor client does;
* ``torchao``: ``torchao.float8.convert_to_float8_training`` with the ``tensorwise`` recipe (the same
  layers: everything but ``lm_head``), compiled with torch.compile where that works (where torchao imports);
* ``bf16+graph`` / ``delayed+graph``: the whole step (forward, backward, clipping, AdamW with
  ``capturable=True``) captured in a CUDA graph by ``fp8_trainer.graphs.GraphedStep`` after three eager
  steps and replayed, inputs copied into static buffers (CUDA only): what is left once the host's launch
  overhead is gone, for both;
* ``bf16+compile`` / ``delayed+compile`` (and ``+graph`` of each): the model under ``torch.compile``
  (default mode). bf16 compiles whole; fp8scope compiles what lies between its FP8 Linears (LayerNorm,
  attention, GELU, residual adds, the head and loss), each FP8 Linear a graph break that runs as it does
  eagerly; ``+graph`` then captures that step as above.

The batch is random token ids already on the device (the data loader is not what is measured), rotating
over a few batches. Each configuration first runs ``--warmup`` steps (compilation, autotuning, allocator),
then ``--steps`` steps timed with one synchronisation before and one after (host clock; CUDA events give
the same within a few microseconds); rounds alternate over the configurations and the table shows the
median over rounds. Goals (CUDA): fp8scope delayed >= 1.3x the tokens/s of bf16, and >= torchao (eager
fp8scope, and fp8scope compiled, each against torchao compiled, where they ran in the same run); the same
1.3x for fp8scope delayed in a CUDA graph, compiled, and both (against eager bf16, the issue's baseline; the
table also shows bf16 in a graph and compiled, and ``x same`` is each row against bf16 run the same way:
torchao, compiled on CUDA, against ``bf16+compile`` where that ran).

    python bench/gpt_throughput.py [--preset 124m] [--batch-size 16] [--seq-len 1024] [--warmup 5]
        [--steps 20] [--rounds 2] [--configs bf16,delayed,current,torchao]
    python bench/gpt_throughput.py --smoke   # tiny preset, 2 steps on the CPU: exercises the script only

The JSON goes to bench/results/gpt_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import types
from contextlib import nullcontext
from pathlib import Path

import torch
from gpu_timing import goal, sync

from fp8_trainer import CurrentScaling, DelayedScaling, StatsReader, convert_to_fp8, fp8_autocast
from fp8_trainer.app.model import GPT, fp8_filter, preset_config
from fp8_trainer.graphs import GraphedStep

CONFIGS = (
    "bf16",
    "delayed",
    "current",
    "torchao",
    "bf16+graph",
    "delayed+graph",
    "bf16+compile",
    "delayed+compile",
    "bf16+compile+graph",
    "delayed+compile+graph",
)
GPT2_VOCAB = 50304  # GPT-2's 50257 padded to a multiple of 64


def _own_code(model: torch.nn.Module) -> None:
    """Give ``model``'s GPT modules forwards with code objects of their own. Dynamo keeps its compiled
    entries per code object, so the configurations compiled in this one process would otherwise share them:
    the bf16 model, compiled whole, then passes the guards of the FP8 model's first graph (which ends at the
    first FP8 Linear, a graph break) and runs in its pieces (measured on the CPU: 6x slower steps)."""
    for m in model.modules():
        f = type(m).forward
        if type(m).__module__ == GPT.__module__:
            own = types.FunctionType(
                f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__, f.__closure__
            )
            m.forward = types.MethodType(own, m)


class Job:
    """One configuration: model, optimizer, the step, and what it measured."""

    def __init__(self, config: str, args: argparse.Namespace, device: torch.device, vocab: int):
        torch.manual_seed(0)
        self.config, self.args, self.device = config, args, device
        with device:  # initialised where it runs: a 1.3b model's init takes tens of seconds on a CPU
            self.model = GPT(preset_config(args.preset, vocab))
        self.recipe = None
        self.reader = None
        self.note = ""
        self.graphed = None
        forward = self.model
        base, *modes = config.split("+")
        self.modes = modes  # how it runs: [], or "compile" and/or "graph"
        graph = "graph" in modes
        if graph and device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA GPU")
        if base in ("delayed", "current"):
            self.recipe = DelayedScaling() if base == "delayed" else CurrentScaling()
            convert_to_fp8(self.model, recipe=self.recipe, module_filter_fn=fp8_filter)
            self.reader = StatsReader(self.model)
        elif config == "torchao":
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            if device.type == "cuda":
                ao_config = Float8LinearConfig.from_recipe_name("tensorwise")
            else:
                ao_config = Float8LinearConfig(emulate=True)
            # by name: lm_head is tied to wte, and torchao converts any nn.Linear unless told not to
            convert_to_float8_training(
                self.model, config=ao_config, module_filter_fn=lambda m, fqn: fqn != "lm_head"
            )
            self.note = "tensorwise" if device.type == "cuda" else "emulate"
            if device.type == "cuda" and not args.no_compile:
                _own_code(self.model)
                forward = torch.compile(self.model)
                self.note += ", compiled"
                self.modes = ["compile"]
        if "compile" in modes:
            _own_code(self.model)
            forward = torch.compile(self.model)
            self.note = "compiled"
        self.forward = forward
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0, capturable=graph
        )
        if graph:
            shape = (args.batch_size, args.seq_len)
            self.x = torch.zeros(shape, dtype=torch.long, device=device)
            self.y = torch.zeros(shape, dtype=torch.long, device=device)
            self.graphed = GraphedStep(self._graph_step, self.model, warmup=3, optimizer=self.opt)
            self.note = "CUDA graph" + (", " + self.note if self.note else "")
        self.losses: list[torch.Tensor] = []
        self.tokens_per_s: list[float] = []
        self.step_ms: list[float] = []
        self.polled = 0

    def _graph_step(self) -> torch.Tensor:
        """The step GraphedStep captures: inputs from the static buffers, gradients written afresh (set to
        None before capture, not zeroed here), autocast without its cast cache (as capture requires)."""
        fp8 = fp8_autocast(fp8_recipe=self.recipe) if self.recipe is not None else nullcontext()
        with fp8, torch.autocast(self.device.type, dtype=torch.bfloat16, cache_enabled=False):
            _, loss = self.forward(self.x, self.y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return loss.detach()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.graphed is not None:
            self.x.copy_(x)
            self.y.copy_(y)
            loss = self.graphed().clone()  # the graph's output buffer is overwritten by the next replay
            if self.reader is not None and self.reader.poll() is not None:
                self.polled += 1
            self.losses.append(loss)
            return
        fp8 = fp8_autocast(fp8_recipe=self.recipe) if self.recipe is not None else nullcontext()
        with fp8, torch.autocast(self.device.type, dtype=torch.bfloat16):
            _, loss = self.forward(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.reader is not None and self.reader.poll() is not None:  # the statistics, one step late
            self.polled += 1
        self.losses.append(loss.detach())


def random_batches(args: argparse.Namespace, vocab: int, device: torch.device, n: int = 4) -> list[tuple]:
    """``n`` batches ``(x, y)`` of random token ids on ``device``, each ``(batch_size, seq_len)``, ``y`` the
    next tokens of ``x`` (seeded: every configuration and script sees the same)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    batches = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), generator=g).to(device)
        batches.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return batches


def run_steps(job: Job, batches: list[tuple[torch.Tensor, torch.Tensor]], n: int, start: int) -> float:
    """Seconds for ``n`` steps, synchronised only before and after."""
    sync(job.device)
    t0 = time.perf_counter()
    for i in range(n):
        x, y = batches[(start + i) % len(batches)]
        job.step(x, y)
    sync(job.device)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="124m")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per configuration (compilation etc.)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration and round")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds, alternating over the configurations")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {CONFIGS}")
    p.add_argument("--no-compile", action="store_true", help="run torchao uncompiled")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny preset, 2 steps, on the CPU")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "gpt_throughput.json"))
    a = p.parse_args(argv)
    if a.smoke:
        a.preset, a.batch_size, a.seq_len, a.warmup, a.steps, a.rounds = "tiny", 2, 32, 1, 2, 1
        a.device = "cpu"
    device = torch.device(a.device)
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        p.error(f"--configs: unknown {bad}; expected a subset of {CONFIGS}")
    vocab = 256 if a.smoke else GPT2_VOCAB

    jobs: dict[str, Job] = {}
    skipped: dict[str, str] = {}
    for config in configs:
        try:
            jobs[config] = Job(config, a, device, vocab)
        except Exception as e:  # torchao missing or not working with this torch, no CUDA for a graph
            if config != "torchao" and "+" not in config:  # a compile or a capture may fail: say so
                raise
            skipped[config] = f"unavailable ({type(e).__name__}: {e})"
    batches = random_batches(a, vocab, device)
    tokens = a.batch_size * a.seq_len

    for config, job in list(jobs.items()):  # warm-up; a compile that fails leaves torchao uncompiled
        try:
            run_steps(job, batches, a.warmup, 0)
        except Exception as e:
            if "+" in config:  # a compile or a capture that fails: say so, measure the others
                skipped[config] = f"failed ({type(e).__name__}: {e})"
                del jobs[config]
                continue
            if config != "torchao":
                raise
            if job.forward is job.model:
                skipped[config] = f"failed ({type(e).__name__}: {e})"
                del jobs[config]
                continue
            job.forward, job.modes = job.model, []
            job.note = job.note.replace("compiled", f"eager (torch.compile failed: {type(e).__name__})")
            try:
                run_steps(job, batches, a.warmup, 0)
            except Exception as e2:
                skipped[config] = f"failed ({type(e2).__name__}: {e2})"
                del jobs[config]
    for r in range(a.rounds):
        for job in jobs.values():
            seconds = run_steps(job, batches, a.steps, r * a.steps)
            job.tokens_per_s.append(a.steps * tokens / seconds)
            job.step_ms.append(seconds * 1e3 / a.steps)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    n_params = sum(p.numel() for p in next(iter(jobs.values())).model.parameters()) if jobs else 0
    print(
        f"GPT {a.preset} ({n_params / 1e6:.1f}M parameters), batch {a.batch_size} x {a.seq_len} tokens, "
        f"{name}, bf16 autocast; {a.warmup} warm-up + {a.steps} timed steps x {a.rounds} rounds"
        + (" (smoke: not a measurement)" if a.smoke else "")
    )
    base = statistics.median(jobs["bf16"].tokens_per_s) if "bf16" in jobs else None
    head = ("config", "tokens/s", "step ms", "x bf16", "x same", "final loss")
    print(f"{head[0]:<30} {head[1]:>12} {head[2]:>9} {head[3]:>7} {head[4]:>7} {head[5]:>10}  notes")
    results = {}
    for config, job in jobs.items():
        tps = statistics.median(job.tokens_per_s)
        same = jobs.get("+".join(["bf16", *job.modes]))  # bf16 run the same way (torchao: compiled)
        x_same = tps / statistics.median(same.tokens_per_s) if same is not None else None
        final = float(job.losses[-1]) if job.losses else float("nan")
        note = job.note or ("statistics read one step late" if job.reader is not None else "")
        results[config] = {
            "tokens_per_s": tps,
            "tokens_per_s_rounds": job.tokens_per_s,
            "step_ms": statistics.median(job.step_ms),
            "x_bf16": tps / base if base else None,
            "x_bf16_same_mode": x_same,
            "final_loss": final,
            "stats_polled": job.polled,
            "note": note,
        }
        ratio = f"{tps / base:7.2f}" if base else f"{'n/a':>7}"
        ratio_same = f"{x_same:7.2f}" if x_same is not None else f"{'n/a':>7}"
        label = config if config.startswith(("bf16", "torchao")) else f"fp8scope {config}"
        step_ms = results[config]["step_ms"]
        print(f"{label:<30} {tps:12,.0f} {step_ms:9.2f} {ratio} {ratio_same} {final:10.4f}  {note}")
    for config, why in skipped.items():
        print(f"{config:<30} {'n/a':>12}  {why}")

    goals = {}
    if device.type == "cuda" and "delayed" in results:
        if base:
            goals["delayed_1.3x_bf16"] = goal(results["delayed"]["x_bf16"], 1.3, "tokens/s vs bf16 autocast")
        if base and "delayed+graph" in results:
            goals["graphed_1.3x_bf16"] = goal(
                results["delayed+graph"]["x_bf16"], 1.3, "tokens/s, fp8scope delayed in a CUDA graph vs bf16"
            )
        for config, key, what in (
            ("delayed+compile", "compiled_1.3x_bf16", "compiled"),
            ("delayed+compile+graph", "compiled_graphed_1.3x_bf16", "compiled and in a CUDA graph"),
        ):
            if base and config in results:
                goals[key] = goal(
                    results[config]["x_bf16"], 1.3, f"tokens/s, fp8scope delayed {what} vs bf16"
                )
        if "torchao" in results:
            goals["delayed_vs_torchao"] = goal(
                results["delayed"]["tokens_per_s"] / results["torchao"]["tokens_per_s"],
                1.0,
                f"tokens/s vs torchao ({results['torchao']['note']})",
            )
        if "torchao" in results and "delayed+compile" in results and "compile" in jobs["torchao"].modes:
            goals["compiled_vs_torchao"] = goal(  # both compiled, both launched eagerly
                results["delayed+compile"]["tokens_per_s"] / results["torchao"]["tokens_per_s"],
                1.0,
                f"tokens/s, fp8scope delayed compiled vs torchao ({results['torchao']['note']})",
            )
        print("goals:")
        for key, gl in goals.items():
            verdict = "met" if gl["met"] else "NOT met"
            print(f"  {key:<26} {gl['value']:6.2f} (target >= {gl['target']:g}): {verdict}")
    else:
        print("goals: assessed on CUDA only")
    finite = all(v["final_loss"] == v["final_loss"] for v in results.values())
    parts = [
        f"{c} {v['tokens_per_s']:,.0f} tok/s" + (f" (x{v['x_bf16']:.2f})" if v["x_bf16"] else "")
        for c, v in results.items()
    ]
    summary = f"{a.preset} b{a.batch_size}x{a.seq_len}: " + ", ".join(parts)
    summary += "".join(f", {c} n/a" for c in skipped) + ("" if finite else "; NON-FINITE LOSS")
    meta = {
        "device": name,
        "device_type": device.type,
        "smoke": a.smoke,
        "torch": torch.__version__,
        "preset": a.preset,
        "parameters": n_params,
        "batch_size": a.batch_size,
        "seq_len": a.seq_len,
        "warmup": a.warmup,
        "steps": a.steps,
        "rounds": a.rounds,
        "vocab_size": vocab,
        "skipped": skipped,
        "timing": "tokens / seconds of N steps with a device synchronisation only before and after; "
        "median over rounds that alternate over the configurations",
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta, "goals": goals, "summary": summary, "results": results}
    out.write_text(json.dumps(data, indent=2))
    print(f"wrote {out}")
    return 0 if finite else 1


if __name__ == "__main__":
    raise SystemExit(main())
