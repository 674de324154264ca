"""``Reader``: a run's data out of the fp8scope monitor service, as numpy arrays or pandas frames.

    from fp8_trainer.monitor.read import Reader

    reader = Reader("http://127.0.0.1:8000")       # or Reader(): FP8SCOPE_URL, FP8SCOPE_TOKEN(_FILE)
    run = reader.runs()[0]                          # newest first
    steps, loss = reader.series(run["id"], "loss")  # (S,) int64, (S,) float64
    stats = reader.stats(run["id"])                 # {"steps": (S,), "amax": (S, T), ...}, T in index order
    df = reader.frame(run["id"], "stats")           # one row per (step, tensor), needs pandas

Values are exactly what the service stored (float64, NaN and infinities included): statistics and scalars
come from the export endpoint (Parquet when pyarrow is installed, else CSV, whose floats read back
exactly), not from the downsampled series or heatmaps. Needs httpx and numpy only; pandas and pyarrow are
used when installed. The module itself uses no torch.
"""

from __future__ import annotations

import csv
import io
from typing import Any

import httpx
import numpy as np

from fp8_protocol.api import API_PREFIX
from fp8_protocol.env import env_token, service_url
from fp8_protocol.packed import unpack_matrix
from fp8_protocol.stats import BASE_COLUMNS, BLOCK_COLUMNS, QUALITY_COLUMNS

__all__ = ["ReadError", "Reader"]

#: the statistics an export may carry, in its order: the base columns, then the quality and the block
#: columns where a step of the range stored them
_EXPORTED = (
    BASE_COLUMNS,
    BASE_COLUMNS + QUALITY_COLUMNS,
    BASE_COLUMNS + BLOCK_COLUMNS,
    BASE_COLUMNS + QUALITY_COLUMNS + BLOCK_COLUMNS,
)
_PAGE = 10_000  # the service's largest events page


class ReadError(RuntimeError):
    """The service could not be read or refused the request; the message says why."""


def _has_pyarrow() -> bool:
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        return False
    return True


def _pandas():
    try:
        import pandas
    except ImportError:
        raise ImportError(
            "Reader.frame needs pandas (pip install pandas); the other Reader methods return numpy arrays"
        ) from None
    return pandas


def response_detail(r: httpx.Response) -> str:
    """The service's reason in an error answer (its JSON ``detail``), else the answer's text."""
    try:
        return str(r.json().get("detail", r.text))
    except (ValueError, AttributeError):  # not JSON, or JSON that is not an object
        return r.text


def refusal(status: int, detail: str, root: str) -> str:
    """What a 4xx answer means, in words (as ``Monitor`` says it)."""
    if status == 401:
        return (
            f"token rejected (HTTP 401: {detail}); pass token=, or set FP8SCOPE_TOKEN or FP8SCOPE_TOKEN_FILE"
        )
    if status == 403:
        return f"the token lacks the 'read' scope (HTTP 403: {detail})"
    if status == 404 and detail.startswith("run "):
        return f"{detail} (HTTP 404)"
    if status in (404, 405):
        return (
            f"no fp8scope API at {root} (HTTP {status}); the URL must be the service root, "
            "e.g. http://127.0.0.1:8000, not a page or an /api path"
        )
    return f"the service refused the request (HTTP {status}: {detail})"


class Reader:
    """Read client of the monitor service (scope ``read``).

    Args:
        url: the service root, e.g. ``"http://127.0.0.1:8000"``; ``None``: ``FP8SCOPE_URL``.
        token: bearer token with the ``read`` scope (when the service has tokens); ``None``:
            ``FP8SCOPE_TOKEN``, else the first line of the file ``FP8SCOPE_TOKEN_FILE`` names.
        timeout: seconds per request (an export of a large run takes a while).
        format: the export format statistics and scalars are fetched in: ``"parquet"`` (the default when
            pyarrow is installed) or ``"csv"``.

    Raises:
        ValueError: no URL, or one that is not ``http(s)://host[:port]``, or an unknown ``format``.
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 300.0,
        format: str | None = None,
    ):
        self.url = service_url(url).rstrip("/")
        token = token if token is not None else env_token()
        if format is None:
            format = "parquet" if _has_pyarrow() else "csv"
        if format not in ("parquet", "csv"):
            raise ValueError(f"format: expected 'parquet' or 'csv', got {format!r}")
        self.format = format
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url + API_PREFIX, headers=headers, timeout=timeout)

    def close(self) -> None:
        """Close the HTTP connections."""
        self._http.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- HTTP -------------------------------------------------------------------------------------------

    def _get(self, path: str, **params: Any) -> httpx.Response:
        params = {k: v for k, v in params.items() if v is not None}
        try:
            r = self._http.get(path, params=params)
        except httpx.HTTPError as e:
            raise ReadError(f"cannot reach the fp8scope service at {self.url} ({e})") from None
        if r.status_code != 200:
            raise ReadError(refusal(r.status_code, response_detail(r)[:300], self.url))
        return r

    def _export(self, run_id: int, table: str, fmt: str, **params: Any) -> bytes:
        return self._get(f"/runs/{run_id}/export", table=table, format=fmt, **params).content

    # --- runs -------------------------------------------------------------------------------------------

    def runs(self, status: str | None = None, limit: int = 1000) -> list[dict[str, Any]]:
        """The runs, newest first (as ``GET /runs``)."""
        return self._get("/runs", status=status, limit=limit).json()

    def run(self, run_id: int) -> dict[str, Any]:
        """One run: name, config, recipe, status, first/last step, ..."""
        return self._get(f"/runs/{run_id}").json()

    def tensors(self, run_id: int) -> list[dict[str, Any]]:
        """The run's quantized tensors by index: ``index, name, layer, role, format``."""
        return self._get(f"/runs/{run_id}/tensors").json()

    # --- numbers ----------------------------------------------------------------------------------------

    def scalars(self, run_id: int, start: int | None = None, end: int | None = None) -> dict[str, np.ndarray]:
        """Every scalar of the stored steps in [start, end]: ``{"steps": (S,) int64, name: (S,) float64}``.
        A step that did not carry a scalar has NaN there (use ``series`` to tell it from a NaN sent)."""
        steps, columns = self._scalar_columns(run_id, start, end)
        return {
            "steps": steps,
            **{name: np.where(present, values, np.nan) for name, (values, present) in columns.items()},
        }

    def series(
        self, run_id: int, name: str, start: int | None = None, end: int | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(steps (S,) int64, values (S,) float64) of one scalar, at every step that carried it."""
        steps, columns = self._scalar_columns(run_id, start, end)
        if name not in columns:
            return np.zeros(0, np.int64), np.zeros(0, np.float64)
        values, present = columns[name]
        return steps[present], values[present]

    def _scalar_columns(
        self, run_id: int, start: int | None, end: int | None
    ) -> tuple[np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]]:
        """steps, and per scalar (values, present) — a missing cell is not a NaN sent."""
        body = self._export(run_id, "scalars", self.format, **{"from": start, "to": end})
        if self.format == "parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(io.BytesIO(body))
            steps = table.column("step").to_numpy().astype(np.int64)
            columns = {}
            for name in table.column_names[1:]:
                col = table.column(name)
                present = ~col.is_null().to_numpy(zero_copy_only=False)
                columns[_scalar_name(name)] = (col.to_numpy(zero_copy_only=False).astype(np.float64), present)
            return steps, columns
        rows = list(csv.reader(io.StringIO(body.decode())))
        header, rows = rows[0], rows[1:]
        steps = np.array([int(r[0]) for r in rows], dtype=np.int64)
        columns = {}
        for j, name in enumerate(header[1:], start=1):
            cells = [r[j] for r in rows]
            present = np.array([c != "" for c in cells], dtype=bool)
            values = np.array([float(c) if c else np.nan for c in cells], dtype=np.float64)
            columns[_scalar_name(name)] = (values, present)
        return steps, columns

    def stats(self, run_id: int, start: int | None = None, end: int | None = None) -> dict[str, np.ndarray]:
        """Every statistic of every tensor at the steps in [start, end] that hold statistics, exactly as
        stored: ``{"steps": (S,) int64, "amax": (S, T) float64, "scale": ..., "numel": ...}``, columns in
        tensor index order (see ``tensors``), with the quality columns (``sum_sq`` ...) and the block columns
        (``blocks`` ...) where a step of the range stored them (NaN at the steps that did not). Steps with
        scalars only (no FP8 layer ran) are left out."""
        T = len(self.tensors(run_id))
        fmt, span = self.format, {"from": start, "to": end}
        try:
            body = self._export(run_id, "stats", fmt, layout="wide", **span)
        except ReadError as exc:  # a run too wide for one Parquet file of this layout: the same table in CSV
            if fmt != "parquet" or "column budget" not in str(exc):
                raise
            fmt = "csv"
            body = self._export(run_id, "stats", fmt, layout="wide", **span)
        if fmt == "parquet":
            import pyarrow.parquet as pq

            table = pq.read_table(io.BytesIO(body))
            steps = table.column("step").to_numpy().astype(np.int64)
            cube = (
                np.column_stack([c.to_numpy() for c in table.columns[1:]]) if T else np.zeros((len(steps), 0))
            )
            names = table.column_names
        else:
            text = body.decode()
            names = next(csv.reader(io.StringIO(text)))
            rows = text.split("\n", 1)[1] if "\n" in text else ""
            if rows.strip():
                data = np.loadtxt(io.StringIO(rows), delimiter=",", ndmin=2, dtype=np.float64)
            else:
                data = np.zeros((0, len(names)))
            # steps as integers (a step above 2**53 has no exact float64)
            firsts = [line.split(",", 1)[0] for line in rows.splitlines() if line]
            steps = np.array([int(x) for x in firsts], dtype=np.int64)
            cube = data[:, 1:]
        # the wide layout is tensor-major, statistic-minor: "<tensor>.<statistic>"
        suffixes = [n.rsplit(".", 1)[-1] for n in names[1:]]
        stats = tuple(suffixes[: len(suffixes) // T]) if T else BASE_COLUMNS
        if stats not in _EXPORTED or suffixes != list(stats) * T:
            raise ReadError(f"unexpected columns in the statistics export: {names[:8]}")
        cube = cube.reshape(len(steps), T, len(stats))
        return {"steps": steps, **{name: np.ascontiguousarray(cube[:, :, j]) for j, name in enumerate(stats)}}

    def heatmap(
        self,
        run_id: int,
        metric: str = "amax",
        start: int | None = None,
        end: int | None = None,
        max_cols: int = 1000,
    ) -> dict[str, Any]:
        """The dashboard's heatmap of one metric (amax, scale, overflow, underflow, nonfinite, headroom):
        ``values`` (T, C) float64 (empty buckets NaN), ``bucket_start``/``bucket_end``/``bucket_steps`` (C,)
        arrays, ``bucket_width`` and ``aggregation``. Buckets keep the max / min / sum of their steps; with
        at most ``max_cols`` steps in the range each bucket is one step."""
        r = self._get(
            f"/runs/{run_id}/heatmap/packed", metric=metric, max_cols=max_cols, **{"from": start, "to": end}
        )
        return _unpack_heatmap(r.content)

    def events(self, run_id: int, kind: str | None = None) -> list[dict[str, Any]]:
        """The run's client events in step order, each ``{"id", "run_id", "kind", "step", "details",
        "created_at"}`` (non-finite floats in ``details`` spelled ``"NaN"``, ``"Infinity"``,
        ``"-Infinity"``)."""
        out: list[dict[str, Any]] = []
        seen: set[int] = set()
        start = None
        while True:
            page = self._get(f"/runs/{run_id}/events", kind=kind, limit=_PAGE, **{"from": start}).json()
            fresh = [e for e in page if e["id"] not in seen]
            out += fresh
            seen.update(e["id"] for e in fresh)
            if len(page) < _PAGE or not fresh:
                return out
            start = page[-1]["step"]  # the next page starts at the last step seen (ids filter repeats)

    def alerts(self, run_id: int, state: str | None = None) -> list[dict[str, Any]]:
        """The run's alerts (at most 5000, most recently updated first), as ``GET /runs/{id}/alerts``."""
        return self._get(f"/runs/{run_id}/alerts", state=state, limit=5000).json()

    def frame(
        self,
        run_id: int,
        table: str = "stats",
        layout: str = "long",
        start: int | None = None,
        end: int | None = None,
    ):
        """A pandas DataFrame of one exported table: ``stats`` (``layout="long"``: step, tensor, layer, role
        and the statistics per row: the six base ones, then the quality and block ones where stored;
        ``"wide"``: one row per step, columns ``<tensor>.<statistic>``),
        ``scalars``, ``events`` or ``alerts`` (the columns of docs/wire-format.md, *Export*).

        Raises:
            ImportError: pandas is not installed.
        """
        pd = _pandas()
        params: dict[str, Any] = {"from": start, "to": end}
        if table == "stats":
            params["layout"] = layout
        body = self._export(run_id, table, self.format, **params)
        if self.format == "parquet":
            import pyarrow.parquet as pq

            return pq.read_table(io.BytesIO(body)).to_pandas()
        # before pandas 3.1 the default float parser may be off by an ulp; from 3.1 every mode is exact and
        # the argument is deprecated
        major, minor = (int(p) for p in pd.__version__.split(".")[:2])
        exact = {} if (major, minor) >= (3, 1) else {"float_precision": "round_trip"}
        return pd.read_csv(io.BytesIO(body), **exact)


def _scalar_name(column: str) -> str:
    return "step" if column == "scalars.step" else column


def _unpack_heatmap(blob: bytes) -> dict[str, Any]:
    """The packed heatmap (`fp8_protocol.packed`) as ``Reader.heatmap`` answers it."""
    head, values = unpack_matrix(blob)
    out = {k: v for k, v in head.items() if k not in ("rows", "cols", "dtype")}
    for key in ("bucket_start", "bucket_end", "bucket_steps"):
        out[key] = np.asarray(out[key], dtype=np.int64)
    out["values"] = values
    return out
