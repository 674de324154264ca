"""Block-scaled tensors (MXFP8, FP8 block scaling): a tensor's block scale exponent histogram over steps."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Response, status

from monitor_server.api.deps import FromQ, ReadRunDep, RunId, RunMetaDep, SessionDep, ToQ, clipped_range
from monitor_server.api.responses import json_response
from monitor_server.storage.block_hist import EXPONENT_BIAS, read_histogram
from monitor_server.storage.query_schemas import BlockHistogramPublic
from monitor_server.storage.run_meta import RunMeta
from monitor_server.storage.schemas import TensorSpec

router = APIRouter(prefix="/runs", tags=["queries"])


def _tensor(meta: RunMeta, tensor: str) -> TensorSpec:
    """The tensor named by its index or its name; 404 when the run has none such."""
    found = None
    if tensor.isdecimal() and len(tensor) <= 9:
        index = int(tensor)
        found = meta.tensors[index] if index < meta.num_tensors else None
    else:
        found = next((t for t in meta.tensors if t.name == tensor), None)
    if found is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"run {meta.run_id} has no tensor {tensor!r}")
    return TensorSpec.model_validate(found, from_attributes=True)


@router.get("/{run_id}/block-histogram", response_model=BlockHistogramPublic)
def get_block_histogram(
    run_id: RunId,
    run: ReadRunDep,
    meta: RunMetaDep,
    session: SessionDep,
    tensor: Annotated[str, Query(min_length=1, max_length=300, description="the tensor's index or its name")],
    from_: FromQ = None,
    to: ToQ = None,
    max_steps: Annotated[int, Query(ge=1, le=10_000, description="at most this many buckets")] = 1000,
) -> Response:
    """A block-scaled tensor's block scale exponent histograms over steps: per aligned bucket of steps (at
    most `max_steps`, a range reaching into compacted steps no finer than 8), the blocks at each biased
    exponent of their scale_inv summed over the bucket's steps. Buckets without a histogram are left out;
    a tensor that never sent one answers no buckets."""
    spec = _tensor(meta, tensor)
    rng = clipped_range(run, from_, to)
    empty = {"bucket_start": [], "bucket_end": [], "bucket_steps": [], "exponent_lo": None}
    if rng is None:
        answer = BlockHistogramPublic(
            tensor=spec,
            from_step=None,
            to_step=None,
            bucket_width=1,
            **empty,
            exponent_hi=None,
            exponent_bias=EXPONENT_BIAS,
            counts=[],
        )
        return json_response(answer)
    hist = read_histogram(session, run_id, spec.index, rng[0], rng[1], max_steps)
    answer = BlockHistogramPublic(
        tensor=spec,
        from_step=rng[0],
        to_step=rng[1],
        bucket_width=hist.width,
        bucket_start=hist.starts,
        bucket_end=hist.ends,
        bucket_steps=hist.steps,
        exponent_bias=EXPONENT_BIAS,
        exponent_lo=hist.lo,
        exponent_hi=None if hist.lo is None else hist.lo + hist.counts.shape[1] - 1,
        counts=hist.counts.tolist(),
    )
    return json_response(answer)
