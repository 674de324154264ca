"""The quantized tensors of a run, as the training job registers them and the service keeps them."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

#: The three quantized tensors of one FP8 Linear, in index order (layer k owns 3k, 3k+1, 3k+2).
ROLES: tuple[str, ...] = ("input", "weight", "grad_output")


@dataclass(frozen=True)
class TensorInfo:
    """One quantized tensor of a run: its stable index and name, owning layer, role and FP8 format.

    `name` is ``<module path>.<role>``; `layer` the module path; `role` one of `ROLES`; `format`
    ``"e4m3"`` or ``"e5m2"``. Forward-then-backward order: the forward tensors (input, weight) in layer
    order, then the grad_output tensors in reverse layer order (backward runs the layers last to first).
    Layer order is the order in which layers first appear when tensors are sorted by `index`. A run's
    registration (``POST /runs``) carries one ``to_dict()`` per tensor.
    """

    index: int
    name: str
    layer: str
    role: str
    format: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
