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
import statistics
import time
import types
from contextlib import nullcontext
from pathlib import Path

import torch
from gpu_common import device_name, failure, meta_head, print_goals, write_json
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


def gpt_parser(doc: str, steps: int, warmup_help: str, steps_help: str) -> argparse.ArgumentParser:
    """A parser (``doc`` its help text) with the model and batch options this benchmark and
    ``gpt_ceiling.py`` share, so that both measure the same preset and batch by the same flags."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="124m")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=5, help=warmup_help)
    p.add_argument("--steps", type=int, default=steps, help=steps_help)
    return p


def add_device_arguments(p: argparse.ArgumentParser) -> None:
    """``--device`` (CUDA where there is one) and ``--smoke`` (see ``apply_smoke``)."""
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny preset, 2 steps, on the CPU")


def apply_smoke(a: argparse.Namespace) -> None:
    """``--smoke``: the tiny preset, a tiny batch and 2 steps on the CPU, which exercises the script only."""
    if a.smoke:
        a.preset, a.batch_size, a.seq_len, a.warmup, a.steps = "tiny", 2, 32, 1, 2
        a.device = "cpu"


def vocab_size(a: argparse.Namespace) -> int:
    """GPT-2's (padded) vocabulary; a small one in a smoke run, where the embedding would dwarf the model."""
    return 256 if a.smoke else GPT2_VOCAB


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, ``--smoke`` applied and ``--configs`` checked and split into ``a.configs``."""
    warmup_help = "untimed steps per configuration (compilation etc.)"
    p = gpt_parser(__doc__, 20, warmup_help, "timed steps per configuration and round")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds, alternating over the configurations")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {CONFIGS}")
    p.add_argument("--no-compile", action="store_true", help="run torchao uncompiled")
    add_device_arguments(p)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "gpt_throughput.json"))
    a = p.parse_args(argv)
    apply_smoke(a)
    if a.smoke:
        a.rounds = 1
    a.configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = [c for c in a.configs if c not in CONFIGS]
    if bad:
        p.error(f"--configs: unknown {bad}; expected a subset of {CONFIGS}")
    return a


def build_jobs(
    a: argparse.Namespace, device: torch.device, vocab: int
) -> tuple[dict[str, Job], dict[str, str]]:
    """A ``Job`` per configuration, and those that could not be set up (torchao missing or not working with
    this torch, no CUDA for a graph), with why. Any other configuration that fails to build is an error."""
    jobs: dict[str, Job] = {}
    skipped: dict[str, str] = {}
    for config in a.configs:
        try:
            jobs[config] = Job(config, a, device, vocab)
        except Exception as e:
            if config != "torchao" and "+" not in config:  # a compile or a capture may fail: say so
                raise
            skipped[config] = f"unavailable ({type(e).__name__}: {e})"
    return jobs, skipped


def warm_up(job: Job, batches: list[tuple], n: int) -> str | None:
    """Run ``job``'s ``n`` untimed steps; ``None`` when they ran, else why the configuration is dropped. A
    compile or a capture that fails is reported, not raised; torchao whose compilation fails falls back to
    eager (noted on the job) and is dropped only if that fails too."""
    try:
        run_steps(job, batches, n, 0)
        return None
    except Exception as e:
        if "+" in job.config:
            return failure(e)
        if job.config != "torchao":
            raise
        if job.forward is job.model:
            return failure(e)
        job.forward, job.modes = job.model, []
        job.note = job.note.replace("compiled", f"eager (torch.compile failed: {type(e).__name__})")
        try:
            run_steps(job, batches, n, 0)
        except Exception as e2:
            return failure(e2)
        return None


def measure(jobs: dict[str, Job], batches: list[tuple], a: argparse.Namespace) -> None:
    """The timed rounds, alternating over the configurations: each job's tokens/s and ms per step."""
    tokens = a.batch_size * a.seq_len
    for r in range(a.rounds):
        for job in jobs.values():
            seconds = run_steps(job, batches, a.steps, r * a.steps)
            job.tokens_per_s.append(a.steps * tokens / seconds)
            job.step_ms.append(seconds * 1e3 / a.steps)


def job_result(job: Job, jobs: dict[str, Job], base: float | None) -> dict:
    """One configuration's medians and ratios: against eager bf16 and against bf16 run the same way."""
    tps = statistics.median(job.tokens_per_s)
    same = jobs.get("+".join(["bf16", *job.modes]))  # bf16 run the same way (torchao: compiled)
    return {
        "tokens_per_s": tps,
        "tokens_per_s_rounds": job.tokens_per_s,
        "step_ms": statistics.median(job.step_ms),
        "x_bf16": tps / base if base else None,
        "x_bf16_same_mode": tps / statistics.median(same.tokens_per_s) if same is not None else None,
        "final_loss": float(job.losses[-1]) if job.losses else float("nan"),
        "stats_polled": job.polled,
        "note": job.note or ("statistics read one step late" if job.reader is not None else ""),
    }


def print_results(results: dict[str, dict], skipped: dict[str, str]) -> None:
    """The table: one row per configuration measured, then those skipped with why."""
    head = ("config", "tokens/s", "step ms", "x bf16", "x same", "final loss")
    print(f"{head[0]:<30} {head[1]:>12} {head[2]:>9} {head[3]:>7} {head[4]:>7} {head[5]:>10}  notes")
    for config, r in results.items():
        ratio = f"{r['x_bf16']:7.2f}" if r["x_bf16"] else f"{'n/a':>7}"
        x_same = r["x_bf16_same_mode"]
        ratio_same = f"{x_same:7.2f}" if x_same is not None else f"{'n/a':>7}"
        label = config if config.startswith(("bf16", "torchao")) else f"fp8scope {config}"
        print(
            f"{label:<30} {r['tokens_per_s']:12,.0f} {r['step_ms']:9.2f} {ratio} {ratio_same} "
            f"{r['final_loss']:10.4f}  {r['note']}"
        )
    for config, why in skipped.items():
        print(f"{config:<30} {'n/a':>12}  {why}")


def assess_goals(results: dict[str, dict], torchao_compiled: bool) -> dict:
    """The CUDA goals: fp8scope delayed (eager, graphed, compiled, both) at 1.3x eager bf16, and at least
    on par with torchao (eager fp8scope, and compiled fp8scope against compiled torchao)."""
    goals = {}
    if "bf16" in results:
        for config, key, what in (
            ("delayed", "delayed_1.3x_bf16", "tokens/s vs bf16 autocast"),
            ("delayed+graph", "graphed_1.3x_bf16", "tokens/s, fp8scope delayed in a CUDA graph vs bf16"),
            ("delayed+compile", "compiled_1.3x_bf16", "tokens/s, fp8scope delayed compiled vs bf16"),
            (
                "delayed+compile+graph",
                "compiled_graphed_1.3x_bf16",
                "tokens/s, fp8scope delayed compiled and in a CUDA graph vs bf16",
            ),
        ):
            if config in results:
                goals[key] = goal(results[config]["x_bf16"], 1.3, what)
    if "torchao" in results:
        ao = results["torchao"]
        goals["delayed_vs_torchao"] = goal(
            results["delayed"]["tokens_per_s"] / ao["tokens_per_s"],
            1.0,
            f"tokens/s vs torchao ({ao['note']})",
        )
        if "delayed+compile" in results and torchao_compiled:
            goals["compiled_vs_torchao"] = goal(  # both compiled, both launched eagerly
                results["delayed+compile"]["tokens_per_s"] / ao["tokens_per_s"],
                1.0,
                f"tokens/s, fp8scope delayed compiled vs torchao ({ao['note']})",
            )
    return goals


def summarise(a: argparse.Namespace, results: dict[str, dict], skipped: dict[str, str], finite: bool) -> str:
    """The one-line summary scripts/gpu-check.sh shows: tokens/s per configuration, against eager bf16."""
    parts = [
        f"{c} {v['tokens_per_s']:,.0f} tok/s" + (f" (x{v['x_bf16']:.2f})" if v["x_bf16"] else "")
        for c, v in results.items()
    ]
    summary = f"{a.preset} b{a.batch_size}x{a.seq_len}: " + ", ".join(parts)
    return summary + "".join(f", {c} n/a" for c in skipped) + ("" if finite else "; NON-FINITE LOSS")


def run_meta(
    a: argparse.Namespace, device: torch.device, n_params: int, vocab: int, skipped: dict[str, str]
) -> dict:
    """What was run, where, and how it was timed: the JSON's ``meta``."""
    return {
        **meta_head(device, a.smoke),
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


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    device = torch.device(a.device)
    vocab = vocab_size(a)
    jobs, skipped = build_jobs(a, device, vocab)
    batches = random_batches(a, vocab, device)
    for config, job in list(jobs.items()):  # warm-up; a compile that fails leaves torchao uncompiled
        why = warm_up(job, batches, a.warmup)
        if why is not None:
            skipped[config] = why
            del jobs[config]
    measure(jobs, batches, a)

    n_params = sum(p.numel() for p in next(iter(jobs.values())).model.parameters()) if jobs else 0
    print(
        f"GPT {a.preset} ({n_params / 1e6:.1f}M parameters), batch {a.batch_size} x {a.seq_len} tokens, "
        f"{device_name(device)}, bf16 autocast; "
        f"{a.warmup} warm-up + {a.steps} timed steps x {a.rounds} rounds"
        + (" (smoke: not a measurement)" if a.smoke else "")
    )
    base = statistics.median(jobs["bf16"].tokens_per_s) if "bf16" in jobs else None
    results = {config: job_result(job, jobs, base) for config, job in jobs.items()}
    print_results(results, skipped)
    goals = {}
    if device.type == "cuda" and "delayed" in results:
        goals = assess_goals(results, "torchao" in jobs and "compile" in jobs["torchao"].modes)
        print("goals:")
        print_goals(goals, 26, "6.2f")
    else:
        print("goals: assessed on CUDA only")
    finite = all(v["final_loss"] == v["final_loss"] for v in results.values())
    data = {
        "meta": run_meta(a, device, n_params, vocab, skipped),
        "goals": goals,
        "summary": summarise(a, results, skipped, finite),
        "results": results,
    }
    write_json(a.out, data)
    return 0 if finite else 1


if __name__ == "__main__":
    raise SystemExit(main())
