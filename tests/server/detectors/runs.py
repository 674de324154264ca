"""Synthetic telemetry for detector tests: a healthy run that detectors must leave alone, plus helpers to
inject one fault at a time, and to cut a run into `StepBatch`es."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fp8_protocol.stats import FP8_MAX
from fp8_protocol.tensors import TensorInfo
from monitor_server.detectors.types import StepBatch

ROLE_FORMAT = {"input": "e4m3", "weight": "e4m3", "grad_output": "e5m2"}
NUMEL = 4096.0 * 1024  # elements per tensor per step in these runs


def make_tensors(n_layers: int, prefix: str = "blocks") -> list[TensorInfo]:
    """Layer i owns tensors 3i (input), 3i+1 (weight), 3i+2 (grad_output), named ``blocks.<i>.fc.<role>``."""
    out = []
    for layer in range(n_layers):
        for r, role in enumerate(("input", "weight", "grad_output")):
            path = f"{prefix}.{layer}.fc"
            out.append(
                TensorInfo(
                    index=3 * layer + r,
                    name=f"{path}.{role}",
                    layer=path,
                    role=role,
                    format=ROLE_FORMAT[role],
                )
            )
    return out


def index_of(tensors: list[TensorInfo], layer: int, role: str) -> int:
    return next(t.index for t in tensors if t.layer.endswith(f".{layer}.fc") and t.role == role)


@dataclass
class Run:
    """A whole run as dense arrays: steps (S,), loss (S,), stats name -> (S, T)."""

    tensors: list[TensorInfo]
    steps: np.ndarray
    loss: np.ndarray
    stats: dict[str, np.ndarray] = field(default_factory=dict)
    loss_present: np.ndarray | None = None

    def batch(self, lo: int = 0, hi: int | None = None) -> StepBatch:
        """Rows [lo, hi) as a StepBatch (copies, so tests may edit runs afterwards)."""
        sl = slice(lo, hi)
        present = {} if self.loss_present is None else {"loss": self.loss_present[sl].copy()}
        return StepBatch(
            steps=self.steps[sl].copy(),
            scalars={"loss": self.loss[sl].copy()},
            stats={k: v[sl].copy() for k, v in self.stats.items()},
            present=present,
        )

    def batches(self, cuts: list[int]) -> list[StepBatch]:
        edges = [0, *cuts, len(self.steps)]
        return [self.batch(a, b) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]

    def rescale(self, margin: float = 0.0, history: int = 1024) -> None:
        """Recompute `scale` from `amax` by delayed scaling (history max, margin), as the runtime would."""
        self.stats["scale"] = delayed_scale(self.stats["amax"], self.fp8_max, margin, history)

    @property
    def fp8_max(self) -> np.ndarray:
        return np.array([FP8_MAX[t.format] for t in self.tensors])


def delayed_scale(amax: np.ndarray, fp8_max: np.ndarray, margin: float, history: int) -> np.ndarray:
    """scale_s = FP8_MAX / max(amax over the `history` steps before s) / 2**margin; step 0 is calibrated."""
    s_len = amax.shape[0]
    ref = np.empty_like(amax)
    ref[0] = amax[0]
    for s in range(1, s_len):
        ref[s] = np.nanmax(amax[max(0, s - history) : s], axis=0)
    return fp8_max[None, :] / ref / 2.0**margin


def healthy_run(n_steps: int = 400, n_layers: int = 4, seed: int = 0, start_step: int = 0) -> Run:
    """Noisy but normal training: decaying loss with 2% noise, amax drifting slowly (well within the
    margin) with lognormal jitter, no overflow, 1% underflow forward and 15-20% for gradients."""
    rng = np.random.default_rng(seed)
    tensors = make_tensors(n_layers)
    n = len(tensors)
    steps = np.arange(start_step, start_step + n_steps, dtype=np.int64)
    t = np.arange(n_steps)
    loss = 2.0 + 3.0 * np.exp(-t / 150.0)
    loss = loss * (1 + 0.02 * rng.standard_normal(n_steps))
    base = rng.uniform(-4, 4, size=n)
    drift = 0.002 * t[:, None]  # log2 per step: over 32 steps 0.06, far below margin + 2
    log2_amax = base[None, :] + drift + 0.15 * rng.standard_normal((n_steps, n))
    amax = 2.0**log2_amax
    numel = np.tile(np.array([NUMEL] * n), (n_steps, 1))
    grad = np.array([m.role == "grad_output" for m in tensors])
    under_frac = np.where(grad, rng.uniform(0.15, 0.20, size=(n_steps, n)), 0.01)
    run = Run(
        tensors=tensors,
        steps=steps,
        loss=loss,
        stats={
            "amax": amax,
            "overflow": np.zeros((n_steps, n)),
            "underflow": np.round(under_frac * numel),
            "nonfinite": np.zeros((n_steps, n)),
            "numel": numel,
        },
    )
    run.rescale()
    return run


def flat_loss_run(
    n_steps: int = 300, n_layers: int = 2, seed: int = 1, level: float = 2.0, noise: float = 0.02
) -> Run:
    """A healthy run whose loss is flat (level + Gaussian noise), so spike sizes are easy to state."""
    run = healthy_run(n_steps, n_layers, seed)
    rng = np.random.default_rng(seed + 100)
    run.loss = level + noise * rng.standard_normal(n_steps)
    return run


def faulty_run(n_layers: int = 4):
    """Every detector fires at least once, some at batch-boundary-sensitive places."""
    run = healthy_run(400, n_layers=n_layers, seed=3)
    run.loss_present = np.ones(400, dtype=bool)
    t = run.tensors
    run.loss[150] *= 2.0
    run.stats["overflow"][100:110, index_of(t, 1, "weight")] = 3e-3 * NUMEL
    run.stats["underflow"][200:230, index_of(t, 2, "input")] = 0.2 * NUMEL
    k = np.clip(np.arange(400) - 250, 0, None)
    run.stats["amax"][:, index_of(t, 3, "input")] = 2.0 ** (0.4 * k)
    run.stats["amax"][120, index_of(t, 0, "grad_output")] *= 2.0**14
    run.rescale()
    run.stats["nonfinite"][300:305, index_of(t, 2, "grad_output")] = 4
    run.stats["nonfinite"][302, index_of(t, 0, "input")] = 1
    run.loss[330] = np.nan
    add_quality(run, seed=3)
    set_sqnr(run, slice(295, None), index_of(t, 1, "input"), level_db=8.0, noise_db=1.0)
    return run


def run_engine(
    run: Run,
    cuts: list[int] | None = None,
    recipe: dict | None = None,
    config=None,
    reload_state: bool = False,
) -> list:
    """Feed `run` to a fresh engine in batches cut at `cuts`; optionally round-trip the state through JSON
    (and a new engine) between batches. Returns all findings.

    Unless `config` sets ``warmup_steps`` itself, the engine starts past its warm-up (``warmup_steps=0``):
    these runs inject faults from step ~50 on, and the warm-up grace has tests of its own."""
    import json

    from monitor_server.detectors.engine import DetectorConfig, DetectorEngine

    config = config or DetectorConfig()
    if "warmup_steps" not in config.model_fields_set:
        config = config.model_copy(update={"warmup_steps": 0})
    engine = DetectorEngine(config, run.tensors, recipe)
    findings = []
    for batch in run.batches(cuts or []):
        findings += engine.process(batch)
        if reload_state:
            state = json.loads(json.dumps(engine.state_dict(), allow_nan=False))
            engine = DetectorEngine(config, run.tensors, recipe, state=state)
    return findings


def keys(findings: list) -> list[tuple]:
    """(kind, tensor_index, step, severity) of each finding, in order."""
    return [(f.kind, f.tensor_index, f.step, f.severity) for f in findings]


def of_kind(findings: list, kind: str) -> list:
    return [f for f in findings if f.kind == kind]


def add_quality(run: Run, seed: int = 0, level_db: float = 30.0, noise_db: float = 1.0) -> Run:
    """Give `run` the quantization-quality columns of healthy FP8 training: each tensor's SQNR at `level_db`
    (± a per-tensor 3 dB) with `noise_db` Gaussian noise per step, an RMS 5-50x below amax, a few
    subnormals, and the smallest non-zero |x| 10-20 binades below amax. Returns the run."""
    rng = np.random.default_rng(seed)
    amax, numel = run.stats["amax"], run.stats["numel"]
    s_len, n = amax.shape
    rms = amax / rng.uniform(5.0, 50.0, size=(1, n)) / rng.uniform(1.0, 1.2, size=(s_len, n))
    sum_sq = rms**2 * (numel - run.stats["nonfinite"])
    sqnr = level_db + rng.uniform(-3.0, 3.0, size=(1, n)) + noise_db * rng.standard_normal((s_len, n))
    run.stats |= {
        "sum_sq": sum_sq,
        "err_sq": sum_sq * 10.0 ** (-sqnr / 10.0),
        "subnormal": rng.poisson(50.0, size=(s_len, n)).astype(np.float64),
        "min_abs": amax * 2.0 ** -rng.uniform(10.0, 20.0, size=(s_len, n)),
    }
    return run


def set_sqnr(run: Run, rows: slice, tensor: int, level_db: float, noise_db: float, seed: int = 0) -> None:
    """Make `tensor`'s SQNR `level_db` ± `noise_db` (Gaussian) over `rows`, by its quantization error."""
    rng = np.random.default_rng(seed)
    sum_sq = run.stats["sum_sq"][rows, tensor]
    sqnr = level_db + noise_db * rng.standard_normal(sum_sq.shape)
    run.stats["err_sq"][rows, tensor] = sum_sq * 10.0 ** (-sqnr / 10.0)
