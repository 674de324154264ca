"""Replay a captured incident (``fp8_trainer.app.incident_capture``) and answer "is it FP8's fault?".

``replay(bundle)`` reruns the bundle's window (the steps from its snapshot up to the failing step, with
their batches, learning rates and injected faults) from the snapshot's state, once per configuration:

1. in the run's recipe: the failing step's loss must come back bit for bit on the CPU (and the fault with
   it), else the verdict is ``not-reproducible``, with the reason;
2. in high precision, FP8 off (float32 on the CPU, bf16 autocast on a GPU, as ``fp8-train --recipe bf16``):
   the fault there too is ``not-fp8`` (bad data, a learning-rate spike, a corrupted weight); gone is
   ``fp8-caused``;
3. for an FP8-caused fault, a bisection: each FP8 layer alone returned to high precision, then (when no
   single layer suffices) the all-high-precision set shrunk one layer at a time while the fault stays away;
   then, per culprit layer, each of its three casts (input, weight, grad_output) alone returned to high
   precision, then pairs. The culprits are the smallest set found, tensors (``<layer>.<role>``) where one
   cast suffices, else layers; ordered by the loss they leave, lowest first.

The fault, in a configuration (``fp8_trainer.app.replay_judge``): a non-finite loss anywhere in the window, or
a failing-step loss at least halfway from the loss the spike rule expected to the loss the run had (for a
non-finite original: ``expected + z_threshold * sigma``, the rule's own spike bar). For a ``grad_overflow``
bundle (a saturated gradient, which need not move the loss) the trigger layer's gradients at the failing
step instead: far from high precision's on the same weights (each FP8 configuration runs that step once
more in high precision for them), or blown up against the window's earlier steps.

A cast alone in high precision runs outside the FP8 layer: the layer's forward is replaced, for that
configuration, by a quantize-dequantize of its FP8 casts with the layer's live scales (the state's own
quantize, recording nothing), around a high-precision GEMM. Its scaling state is then not updated within
the window (the history's maximum usually holds it); the ``emulated`` configuration (every cast through the
emulation) shows whether the emulation itself reproduces the fault. Block-scaled layers are bisected by
layer only.

Evidence per configuration: the window's losses, the failing step's loss, whether it faulted, and each FP8
layer's output SQNR (dB) against the high-precision run at the failing step's first micro-batch. The report
is JSON-able (``fp8_protocol.codec.jsonable`` spelling of NaN and infinity).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fp8_protocol.codec import jsonable
from fp8_protocol.replay import VERDICTS

from ..convert import convert_to_fp8, get_fp8_state, set_layer_recipe
from ..formats import ROLES
from ..linear import Linear
from .build import make_optimizer, make_recipe
from .incident_capture import load_bundle, step_batches
from .inject import Injection, Injector
from .model import GPT, fp8_filter, preset_config
from .replay_judge import GradJudge, LossJudge, judge_for, layer_norm
from .train_config import TrainConfig
from .train_step import forward_backward, optimizer_step

__all__ = ["VERDICTS", "replay", "post_report", "main"]


def _train_config(config: dict[str, Any]) -> TrainConfig:
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {k: v for k, v in config.items() if k in names}
    for k in ("tags", "inject"):
        values[k] = tuple(values.get(k) or ())
    return TrainConfig(**values)


class _Window:
    """The bundle's window, ready to run in one configuration at a time."""

    def __init__(self, bundle: dict[str, Any], device: torch.device):
        self.bundle, self.device = bundle, device
        self.a = _train_config(bundle["config"])
        self.vocab_size = bundle["config"]["vocab_size"]
        self.recipe = make_recipe(self.a)
        self.steps = bundle["steps"]
        trigger = bundle["trigger"]  # a gradient trigger's layer: its gradient norm in every step
        self.watch = trigger["tensor"].rsplit(".", 1)[0] if trigger.get("kind") == "grad_overflow" else None
        self.layers: list[str] = []
        if self.recipe is not None:
            self.layers = list(get_fp8_state(self._build()[0]).layer_names)

    def _build(self):
        a = self.a
        torch.manual_seed(a.seed)
        cfg = replace(preset_config(a.preset, self.vocab_size), checkpoint=a.activation_checkpointing)
        model = GPT(cfg).to(self.device)
        if self.recipe is not None:
            convert_to_fp8(model, recipe=self.recipe, module_filter_fn=fp8_filter)
            if not a.quality_stats:
                get_fp8_state(model).set_quality_stats(False)
            get_fp8_state(model).set_quality_schedule(
                a.quality_every or (10 if self.device.type == "cuda" else 1)
            )
        return model, make_optimizer(a, model)

    def run(self, fp8: bool, hp_layers=(), hp_casts: dict[str, set[str]] | None = None) -> dict[str, Any]:
        """Run the window: FP8 as the run had it (``fp8``), but for ``hp_layers`` in high precision and, per
        layer of ``hp_casts``, those casts in high precision (the others emulated). The losses, the
        failing step's first-micro-batch output of every FP8 layer."""
        snap = self.bundle["snapshot"]
        model, opt = self._build()
        model.load_state_dict(snap["model"])
        # a copy: the optimizer keeps the loaded tensors and steps them in place
        opt.load_state_dict(copy.deepcopy(snap["optimizer"]))
        for group in opt.param_groups:
            group["capturable"] = False
        torch.set_rng_state(snap["rng"]["torch"])
        if "cuda" in snap["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state_all(snap["rng"]["cuda"])
        for name in hp_layers:
            set_layer_recipe(model, name, fp8_enabled=False)
        for name, roles in (hp_casts or {}).items():
            _emulate(model.get_submodule(name), roles)
        recipe = self.recipe if fp8 else None
        outputs: dict[str, torch.Tensor] = {}
        losses, grad_norms, grads, layer_norms, layer_ref = [], [], {}, [], {}
        injector = Injector(model, [])
        for i, record in enumerate(self.steps):
            last = i == len(self.steps) - 1
            injector.injections = [Injection(**d) for d in record["injections"]]
            for group in opt.param_groups:
                group["lr"] = record["lr"]
            injector.begin(record["step"])
            if last and fp8 and self.watch is not None:
                layer_ref = self._hp_gradients(model, record, list(hp_casts or ()))
            # after the faults' hooks: each layer's output as the model goes on with it
            hooks = _output_hooks(model, self.layers, outputs) if last else []
            loss = forward_backward(self.a, model, step_batches(record, self.device), recipe, self.device, 1)
            injector.end(record["step"])
            for h in hooks:
                h.remove()
            if self.watch is not None:
                layer_norms.append(layer_norm(model, self.watch))
            if last:
                grads = {
                    n: p.grad.detach().to("cpu", torch.float32, copy=True)
                    for n, p in model.named_parameters()
                    if p.grad is not None
                }
                if not fp8 and self.watch is not None:  # high precision is its own reference
                    layer_ref = {n: g for n, g in grads.items() if n.startswith(self.watch + ".")}
            grad_norms.append(float(optimizer_step(self.a, model, opt)))
            losses.append(float(loss))
        return {
            "losses": losses,
            "grad_norms": grad_norms,
            "outputs": outputs,
            "grads": grads,
            "layer_norms": layer_norms,
            "layer_ref": layer_ref,
        }

    def _hp_gradients(self, model: nn.Module, record: dict[str, Any], emulated: list[str]) -> dict[str, Any]:
        """The watched layer's parameter gradients of ``record``'s step in high precision, from the weights
        the configuration has reached (the faults' hooks on, the casts' emulation off, the RNG as it was):
        its gradients' reference where the fault is in the gradients (``replay_judge.GradJudge``)."""
        mods = [model.get_submodule(n) for n in emulated]
        forwards = [mod.__dict__.pop("forward") for mod in mods]  # back to the layer's own forward
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                forward_backward(self.a, model, step_batches(record, self.device), None, self.device, 1)
        finally:
            for mod, forward in zip(mods, forwards, strict=True):
                mod.forward = forward
        prefix = f"{self.watch}."
        ref = {
            n: p.grad.detach().to("cpu", torch.float32, copy=True)
            for n, p in model.named_parameters()
            if p.grad is not None
        }
        model.zero_grad(set_to_none=True)
        return {n: g for n, g in ref.items() if n.startswith(prefix)}


class _Substitute(torch.autograd.Function):
    """``value`` in the forward, the gradient passed to ``t`` unchanged (a straight-through cast)."""

    @staticmethod
    def forward(ctx, t, value):
        return value

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GradCast(torch.autograd.Function):
    """The identity in the forward; the gradient through tensor ``i``'s FP8 cast in the backward."""

    @staticmethod
    def forward(ctx, t, state, i):
        ctx.state, ctx.i = state, i
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return _fake_cast(ctx.state, ctx.i, grad), None, None


def _fake_cast(state, i: int, t: torch.Tensor) -> torch.Tensor:
    """``t`` through tensor ``i``'s FP8 cast and back, with the state's live scale (nothing recorded)."""
    flat = t.detach().reshape(-1, t.shape[-1]).contiguous()
    q, scale_inv = state.quantize(i, flat, False)[:2]
    return (q.float() * scale_inv).to(t.dtype).reshape(t.shape)


def _emulate(mod: Linear, hp_roles: set[str]) -> None:
    """Replace ``mod``'s forward: its casts but ``hp_roles`` emulated, the GEMM in high precision."""
    state, k = mod._fp8_state, mod._fp8_index
    if state.block_specs[k] is not None:
        raise ValueError(f"{state.layer_names[k]}: a block-scaled layer is bisected by layer only")

    def forward(x: torch.Tensor) -> torch.Tensor:
        w = mod.gemm_weight()
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
            w = w.to(x.dtype)
        if "input" not in hp_roles:
            x = _Substitute.apply(x, _fake_cast(state, 3 * k, x))
        if "weight" not in hp_roles:
            w = _Substitute.apply(w, _fake_cast(state, 3 * k + 1, w))
        out = F.linear(x, w, mod.bias)
        if "grad_output" not in hp_roles and out.requires_grad:
            out = _GradCast.apply(out, state, 3 * k + 2)
        return out

    mod.forward = forward


def _output_hooks(model: nn.Module, layers: list[str], outputs: dict[str, torch.Tensor]) -> list:
    def hook(name):
        def keep(module, args, out):
            if name not in outputs and torch.is_grad_enabled():  # the first micro-batch, not a recompute
                outputs[name] = out.detach().float().cpu()

        return keep

    return [model.get_submodule(n).register_forward_hook(hook(n)) for n in layers]


def replay(bundle_path: str | Path, *, bisect: bool = True, device: str = "cpu") -> dict[str, Any]:
    """Replay the bundle's window and return the JSON-able report: ``verdict`` (one of ``VERDICTS``),
    ``reason``, ``culprits`` (tensors or layers, the most likely first), and the evidence per configuration
    (module docstring)."""
    bundle = load_bundle(bundle_path)
    dev = torch.device(device)
    cuda = [dev] if dev.type == "cuda" else []
    with torch.random.fork_rng(
        devices=cuda
    ):  # the window sets the RNG states; the caller's stay as they were
        return _replay(bundle, bundle_path, dev, bisect)


def _replay(bundle: dict[str, Any], bundle_path, dev: torch.device, bisect: bool) -> dict[str, Any]:
    trigger, step = bundle["trigger"], bundle["step"]
    report: dict[str, Any] = {
        "bundle": str(bundle_path),
        "step": step,
        "trigger": trigger,
        "window": [bundle["snapshot"]["step"] + 1, step],
        "verdict": None,
        "reason": "",
        "culprits": [],
        "configs": [],
    }
    missing = [r["step"] for r in bundle["steps"] if not r["batches"]]
    if not bundle["steps"] or bundle["steps"][-1]["step"] != step or missing:
        report.update(
            verdict="not-reproducible", reason=f"missing state: no batches for steps {missing or [step]}"
        )
        return jsonable(report)
    window = _Window(bundle, dev)
    configs = report["configs"]
    hp = window.run(fp8=False)
    original = trigger["loss"]
    if window.recipe is None:
        configs.append(judge_for(trigger).entry("run", [], hp, None))
        report["bitwise"] = _same(hp["losses"][-1], original)
        if configs[0]["fault"]:
            report.update(verdict="not-fp8", reason="the run did not train in FP8")
        else:
            report.update(verdict="not-reproducible", reason=_not_reproduced(configs[0], trigger))
        return jsonable(report)

    fp8 = window.run(fp8=True)
    judge = judge_for(trigger, fp8, hp)  # the reason says which: "loss ..." or "...'s gradients ..."
    configs.append(judge.entry("fp8", [], fp8, hp))
    configs.append(judge.entry("high-precision", window.layers, hp, hp))
    report["bitwise"] = _same(fp8["losses"][-1], original)
    fp8_entry, hp_entry = configs
    if not (report["bitwise"] or fp8_entry["fault"]):
        report.update(verdict="not-reproducible", reason=_not_reproduced(fp8_entry, trigger))
        return jsonable(report)
    if hp_entry["fault"]:
        report.update(
            verdict="not-fp8",
            reason=f"the fault comes back in high precision too ({judge.describe(hp_entry)} at step {step})",
        )
        return jsonable(report)
    if not fp8_entry["fault"]:
        report.update(
            verdict="not-reproducible",
            reason=f"step {step} replays bit for bit, but its loss is not faulty in either precision",
        )
        return jsonable(report)
    report.update(
        verdict="fp8-caused",
        reason=f"the fault comes back in FP8 ({judge.describe(fp8_entry)}) and is gone in high precision "
        f"({judge.describe(hp_entry)})",
    )
    if bisect:
        report["culprits"] = _bisect(window, judge.for_bisection(fp8_entry, hp_entry), hp, configs)
    return jsonable(report)


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _not_reproduced(entry: dict[str, Any], trigger: dict[str, Any]) -> str:
    return (
        f"the replay in the run's recipe gave loss {entry['loss']:.6g} at the failing step where the run had "
        f"{trigger['loss']:.6g} ({'the same' if _same(entry['loss'], trigger['loss']) else 'not the same'} "
        "value; non-determinism, or a fault from outside the captured state)"
    )


def _bisect(window: _Window, judge: LossJudge | GradJudge, reference, configs: list) -> list[str]:
    """Append the bisection's configurations to ``configs``; return the culprits (module docstring)."""

    def run(name, hp_layers=(), hp_casts=None):
        result = window.run(fp8=True, hp_layers=hp_layers, hp_casts=hp_casts)
        entry = judge.entry(name, list(hp_layers) + _cast_names(hp_casts), result, reference)
        configs.append(entry)
        return entry

    singles = {name: run(f"layer {name}", [name]) for name in window.layers}
    fixers = sorted((judge.order(e), n) for n, e in singles.items() if not e["fault"])
    if fixers:
        culprit_layers = [n for _, n in fixers]  # each alone suffices: the smallest sets, best first
        groups = [[n] for n in culprit_layers]
    else:  # no single layer: shrink the all-high-precision set while the fault stays away
        keep = list(window.layers)
        for name in sorted(window.layers, key=lambda n: -judge.order(singles[n])):  # least helpful first
            trial = [n for n in keep if n != name]
            if trial and not run(f"layers {len(trial)}", trial)["fault"]:
                keep = trial
        groups = [keep]
        culprit_layers = keep

    tensors: list[tuple[float, str]] = []
    blocked = set(culprit_layers) if window.a.recipe in ("mxfp8", "block") else set()  # by layer only
    for group in groups[:3]:  # the three best single layers at most: each is one cast bisection
        for layer in group:
            if layer in blocked:
                continue
            others = [n for n in group if n != layer]
            emulated = run(f"emulated {layer}", others, {layer: set()})
            if not emulated["fault"]:
                continue  # the emulation does not reproduce the fault: the layer stays the culprit
            found = []
            for role in ROLES:
                e = run(f"cast {layer}.{role}", others, {layer: {role}})
                if not e["fault"]:
                    found.append((judge.order(e), f"{layer}.{role}"))
            if not found:
                for pair in ((0, 1), (0, 2), (1, 2)):
                    roles = {ROLES[i] for i in pair}
                    e = run(f"casts {layer}.{'+'.join(sorted(roles))}", others, {layer: roles})
                    if not e["fault"]:
                        found.append((judge.order(e), "+".join(f"{layer}.{r}" for r in sorted(roles))))
            tensors.extend(found)
    if tensors:
        named = [t for _, t in sorted(tensors)]
        return named + [n for n in culprit_layers if not any(t.startswith(n + ".") for t in named)]
    return culprit_layers


def _cast_names(hp_casts) -> list[str]:
    return [f"{n}.{r}" for n, roles in (hp_casts or {}).items() for r in sorted(roles)]


def post_report(
    report: dict[str, Any],
    monitor_url: str | None,
    run_id: int,
    incident_id: int,
    *,
    token: str | None = None,
    timeout: float = 60.0,
) -> dict[str, Any]:
    """Store ``report`` (as `replay` returns it) on incident ``incident_id`` of run ``run_id`` of the
    monitor at ``monitor_url`` (None: ``FP8SCOPE_URL``): ``PUT .../incidents/{id}/replay``; the token from
    ``token``, else ``FP8SCOPE_TOKEN`` / ``FP8SCOPE_TOKEN_FILE``. Returns the stored replay as the service
    answers it; raises ``RuntimeError`` naming the refusal (the service's message) or the failure."""
    import httpx

    from fp8_protocol.api import API_PREFIX
    from fp8_protocol.env import env_token, service_url

    from ..monitor.read import response_detail

    root = service_url(monitor_url).rstrip("/")
    token = token if token is not None else env_token()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    url = f"{root}{API_PREFIX}/runs/{int(run_id)}/incidents/{int(incident_id)}/replay"
    try:
        r = httpx.put(url, json=report, headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        raise RuntimeError(f"cannot reach the fp8scope service at {root} ({e})") from None
    if r.status_code != 200:
        detail = response_detail(r)[:500]
        raise RuntimeError(f"the service refused the report (HTTP {r.status_code}): {detail}")
    return r.json()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fp8-train replay", description="Replay an incident bundle: is the fault FP8's, and where?"
    )
    p.add_argument("bundle", help="an incident bundle (fp8-train --capture-dir writes them)")
    p.add_argument("--no-bisect", dest="bisect", action="store_false", help="the verdict only")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--json", metavar="PATH", help="write the report here (default: stdout, after the summary)"
    )
    g = p.add_argument_group("store the report on its incident (token: $FP8SCOPE_TOKEN(_FILE))")
    g.add_argument("--monitor-url", help="the fp8scope service (e.g. http://127.0.0.1:8000)")
    g.add_argument("--run-id", type=int, help="the run the incident belongs to")
    g.add_argument("--incident", type=int, metavar="ID", help="the incident (its id on the dashboard)")
    return p


def main(argv: list[str] | None = None) -> int:
    """``fp8-train replay BUNDLE``: prints the verdict and culprits, the report as JSON."""
    p = build_parser()
    a = p.parse_args(argv)
    post = (a.monitor_url, a.run_id, a.incident)
    if any(v is not None for v in post) and any(v is None for v in post):
        p.error("--monitor-url, --run-id and --incident go together")
    try:
        report = replay(a.bundle, bisect=a.bisect, device=a.device)
    except ValueError as e:
        print(f"fp8-train replay: {e}", file=sys.stderr)
        return 2
    print(f"verdict: {report['verdict']} ({report['reason']})")
    if report["culprits"]:
        print("culprits: " + ", ".join(report["culprits"]))
    text = json.dumps(report, indent=1)
    if a.json:
        Path(a.json).write_text(text + "\n", encoding="utf-8")
    else:
        print(text)
    if a.monitor_url is not None:
        try:
            post_report(report, a.monitor_url, a.run_id, a.incident)
        except (RuntimeError, ValueError) as e:
            print(f"fp8-train replay: {e}", file=sys.stderr)
            return 1
        print(f"stored on incident {a.incident} of run {a.run_id} at {a.monitor_url}")
    return 0
