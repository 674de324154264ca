"""Model-level API: convert a model to FP8, look up its tensors, close steps, change recipes per layer."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from .linear import Conv1D, Linear, is_conv1d
from .recipe import Recipe
from .state import FP8State, TensorInfo

__all__ = [
    "convert_to_fp8",
    "end_step",
    "get_fp8_state",
    "get_layer_recipes",
    "ineligible_layers",
    "set_layer_recipe",
    "tensor_table",
]

log = logging.getLogger(__name__)


def _other_runtime(mod: nn.Module) -> str | None:
    """Why ``mod``, a linear layer of another library, is left as it is (``None``: not such a layer)."""
    cls = type(mod)
    where = f"{cls.__module__}.{cls.__qualname__}"
    if isinstance(mod, nn.Linear) and cls is not nn.Linear and not isinstance(mod, Linear):
        # torchao's Float8Linear, a quantized or LoRA Linear...: replacing it would silently drop its runtime
        return f"{where} is another runtime's nn.Linear subclass; left to that runtime"
    return None


def _fp8_layer(mod: nn.Module) -> Linear | None:
    """``mod`` as an FP8 layer sharing its parameters, or ``None`` where it is not a linear layer fp8scope
    converts (a plain ``nn.Linear``, a transformers ``Conv1D``)."""
    if is_conv1d(mod):
        return Conv1D.from_conv1d(mod)
    if isinstance(mod, nn.Linear) and not isinstance(mod, Linear):
        return Linear.from_linear(mod)
    return None


def _shape_reason(mod: nn.Module) -> str | None:
    """Why a linear layer's shape keeps it out of FP8 (``None``: it fits): both features multiples of 16."""
    if is_conv1d(mod):
        in_f, out_f = mod.weight.shape
    else:
        in_f, out_f = mod.in_features, mod.out_features
    if in_f % 16 or out_f % 16:
        return f"in_features={in_f}, out_features={out_f}: not multiples of 16"
    return None


def _check_not_pending(module: nn.Module, state_dict, prefix: str, *args) -> None:
    """``load_state_dict`` pre-hook of a converted model: refuse before any parameter is overwritten."""
    state = getattr(module, "_fp8_state", None)
    if state is not None and state.n_layers:
        state.check_not_pending(state.layer_names[0] or "<root>")


def convert_to_fp8(
    model: nn.Module,
    recipe: Recipe | None = None,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> nn.Module:
    """Swap every eligible ``nn.Linear`` of ``model`` for an FP8 ``Linear``, and every transformers ``Conv1D``
    (GPT-2) for an FP8 ``Conv1D`` (in place; parameters are shared).

    Eligible: a plain ``nn.Linear`` (not a subclass: another runtime's layer, e.g. torchao's
    ``Float8Linear``, is never replaced) or a transformers ``Conv1D``, both dimensions multiples of 16 and
    ``module_filter_fn(module, fqn)`` true (when given). Layers left out for their shape or because they
    belong to another runtime are logged once, with the reason, and listed by
    ``ineligible_layers(model)``; what was converted is logged too. FP8 ``Linear`` layers already in the
    model are registered too, so this is also how a model built from ``fp8_trainer.Linear`` directly gets
    its tensor registry. Converting starts a fresh scaling state: convert first, then ``load_state_dict`` a
    checkpoint (each FP8 layer restores its slice of the state from its ``_extra_state`` entry).

    Returns:
        ``model`` (or the new module if ``model`` itself was a converted ``nn.Linear``).
    """
    ineligible: dict[str, str] = {}

    def swap(parent: nn.Module, prefix: str) -> None:
        for child_name, child in list(parent.named_children()):
            fqn = f"{prefix}.{child_name}" if prefix else child_name
            other = _other_runtime(child)
            if other is not None:
                if module_filter_fn is None or module_filter_fn(child, fqn):
                    ineligible[fqn] = other
                continue
            if isinstance(child, nn.Linear) and not isinstance(child, Linear) or is_conv1d(child):
                if module_filter_fn is not None and not module_filter_fn(child, fqn):
                    continue
                reason = _shape_reason(child)
                if reason:
                    ineligible[fqn] = reason
                    continue
                setattr(parent, child_name, _fp8_layer(child))
            else:
                swap(child, fqn)

    if type(model) is nn.Linear or is_conv1d(model):
        if _shape_reason(model) is None and (module_filter_fn is None or module_filter_fn(model, "")):
            model = _fp8_layer(model)
    elif _other_runtime(model) is None:
        swap(model, "")
    if ineligible:
        shown = list(ineligible.items())[:3]
        more = f"; and {len(ineligible) - 3} more" if len(ineligible) > 3 else ""
        left = "; ".join(f"{fqn}: {reason}" for fqn, reason in shown) + more
        log.warning(
            "convert_to_fp8: %d layer(s) left out of FP8 (ineligible_layers(model) lists them, and the run's "
            "config on the dashboard): %s",
            len(ineligible),
            left,
        )

    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]
    log.info("convert_to_fp8: %d FP8 layer(s): %s", len(layers), ", ".join(n or "<root>" for n, _ in layers))
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), None)
    shapes = [(m.out_features, m.in_features) for _, m in layers]
    state = FP8State([name for name, _ in layers], recipe, device=device, layer_shapes=shapes)
    state.ineligible = ineligible
    for k, (_, m) in enumerate(layers):
        m._bind(state, k)
    model._fp8_state = state
    if not getattr(model, "_fp8_load_check", False):
        model.register_load_state_dict_pre_hook(_check_not_pending)
        model._fp8_load_check = True
    return model


def get_fp8_state(model: nn.Module) -> FP8State:
    """The ``FP8State`` of a converted model (registers its FP8 layers on first use if needed)."""
    state = getattr(model, "_fp8_state", None)
    if state is None:
        if isinstance(model, Linear) and model._fp8_state is not None:
            return model._fp8_state
        convert_to_fp8(model, module_filter_fn=lambda m, n: False)
        state = model._fp8_state
    return state


def tensor_table(model: nn.Module) -> list[TensorInfo]:
    """Every quantized tensor of ``model`` with its stable index and name, in index order.

    Layer k (the k-th FP8 Linear in ``model.named_modules()`` order) owns 3k (input), 3k+1 (weight) and
    3k+2 (grad_output); rows of ``step_stats(model)`` follow this order.
    """
    return get_fp8_state(model).tensor_table()


def ineligible_layers(model: nn.Module) -> dict[str, str]:
    """Layers ``convert_to_fp8`` left out of FP8 (their shape, another runtime's layer, a transformers
    ``Conv1D``), with reasons, keyed by module path."""
    return dict(get_fp8_state(model).ineligible)


def end_step(model: nn.Module) -> None:
    """Close the step in progress now: its amaxes enter the history and the scales are updated.

    Not needed in the usual loops (see ``fp8_autocast``); harmless when the step was closed already.
    """
    get_fp8_state(model).end_step()


def _layer_arg(state: FP8State, layer_name: str | None) -> int | None:
    if layer_name is None or layer_name == "model":
        return None
    if not isinstance(layer_name, str):
        raise ValueError(f"layer_name: expected a string, got {layer_name!r}")
    return state.layer_index(layer_name)


def set_layer_recipe(
    model: nn.Module,
    layer_name: str | None = None,
    *,
    margin: int | float | None = None,
    amax_history_len: int | None = None,
    amax_compute_algo: str | None = None,
    interval: int | None = None,
    scaling: str | None = None,
    fp8_enabled: bool | None = None,
) -> dict[str, Any]:
    """Override recipe settings of one FP8 layer (``layer_name`` = its module path) or of the whole model
    (``None`` or ``"model"``). Call it between two optimizer steps; it applies from the next forward.

    ``scaling`` is ``"delayed"`` or ``"current"`` (per-tensor scales), or ``"mxfp8"`` or ``"block"``
    (block-scaled: the block parameters come from the model's recipe when it is that block recipe, from
    Transformer Engine's defaults otherwise; MXFP8 needs both dimensions divisible by 32);
    ``fp8_enabled=False`` runs the layer in the input's precision. A shorter ``amax_history_len`` keeps the
    newest entries. Layer settings win over model-wide ones.

    Returns:
        The previous effective values of the settings given: passing them back rolls the change back.
    Raises:
        ValueError: unknown layer or invalid value (nothing is changed then).
    """
    state = get_fp8_state(model)
    k = _layer_arg(state, layer_name)
    changes = {
        key: value
        for key, value in dict(
            margin=margin,
            amax_history_len=amax_history_len,
            amax_compute_algo=amax_compute_algo,
            interval=interval,
            scaling=scaling,
            fp8_enabled=fp8_enabled,
        ).items()
        if value is not None
    }
    return state.apply_settings(k, changes)


def get_layer_recipes(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Effective recipe settings per FP8 layer (JSON-able), keyed by module path."""
    state = get_fp8_state(model)
    out = {}
    for k, name in enumerate(state.layer_names):
        s = state.layer_settings(k)
        out[name] = {**s, "fp8_format": s["fp8_format"].value}
    return out
