"""Settings: explicit argument > environment variable > ``[tool.metadist]`` in pyproject.toml > default.

| setting        | environment                | pyproject key   | default            |
|----------------|----------------------------|-----------------|--------------------|
| solver         | METADIST_SOLVER            | solver          | ilp                |
| memory_budget  | METADIST_MEMORY_BUDGET     | memory_budget   | none (bytes/device)|
| cache_dir      | METADIST_CACHE_DIR         | cache_dir       | user cache dir     |
| mesh_profile   | METADIST_MESH_PROFILE      | mesh_profile    | built-in defaults  |
| axis_size      | METADIST_AXIS_SIZE         | axis_size       | 2 (discovery)      |
| time_limit     | METADIST_TIME_LIMIT        | time_limit      | 60 (solver, s)     |
| coalesce       | METADIST_COALESCE          | coalesce        | true (bucket all-reduces) |
| bucket_mb      | METADIST_BUCKET_MB         | bucket_mb       | 25 (MiB per bucket)|
| first_bucket_mb | METADIST_FIRST_BUCKET_MB  | first_bucket_mb | auto (MiB of the first gradient bucket: DDP's 1 where the device overlaps communication, else bucket_mb; 0: bucket_mb) |
| shard_bucket_mb | METADIST_SHARD_BUCKET_MB | shard_bucket_mb | 4 (MiB per bucket of parameter all_gathers and gradient reduce_scatters; 0: off) |
| beam_width     | METADIST_BEAM_WIDTH        | beam_width      | 8 (beam solver)    |
| verify_draws   | METADIST_VERIFY_DRAWS      | verify_draws    | 2 (random draws per rule) |
| progress       | METADIST_PROGRESS          | progress        | on a terminal      |
| max_real_discovery | METADIST_MAX_REAL_DISCOVERY | max_real_discovery | 2**24 elements |
| discovery_workers | METADIST_DISCOVERY_WORKERS | discovery_workers | 0 (one process per core, forked, for 12+ patterns; 1: none) |
| measure_links  | METADIST_MEASURE_LINKS     | measure_links   | true (measure on first compile) |
| strategy       | METADIST_STRATEGY          | strategy        | auto (or a preset: ddp, zero1..3, fsdp, tp, tp+dp) |
| micro_batches  | METADIST_MICRO_BATCHES     | micro_batches   | 1 (no accumulation)|
| pipeline_stages| METADIST_PIPELINE_STAGES   | pipeline_stages | none (planner; k: k stages on axis 0)|
| schedule       | METADIST_SCHEDULE          | schedule        | 1f1b               |
| grad_compression | METADIST_GRAD_COMPRESSION | grad_compression | none (bf16, fp16) |
| measure_memory | METADIST_MEASURE_MEMORY    | measure_memory  | true (the first call after each compile: step.memory) |
| recompute      | METADIST_RECOMPUTE         | recompute       | true (only when a memory budget needs it) |
| offload        | METADIST_OFFLOAD           | offload         | none ("optimizer": state and update on the host) |
| ilp_cache_mb   | METADIST_ILP_CACHE_MB      | ilp_cache_mb    | 512 (MiB of kept ILP answers; the least recently used go first) |
| autotune       | METADIST_AUTOTUNE          | autotune        | true (with measured costs: the solver's plan timed beside the ddp, zero1 and fsdp presets', the fastest kept; frontends that can time a plan alone: JAX) |
| autotune_seconds | METADIST_AUTOTUNE_SECONDS | autotune_seconds | 60 (autotune's time: programs not compiled by then are left untimed) |
| local_time_seconds | METADIST_LOCAL_TIME_SECONDS | local_time_seconds | 10 (with measured costs, time a compile may spend timing matmuls at each strategy's local shapes, metadist_core.localtime; 0: none, every op at its roofline; frontends that time them: JAX) |
| max_replans    | METADIST_MAX_REPLANS       | max_replans     | 8 (re-plans of a step after a failed guard before one warning says the loop re-plans every call) |
| guard_cache    | METADIST_GUARD_CACHE       | guard_cache     | 8 (compiled programs kept per call signature, for when an earlier state returns) |
| sync_guards    | METADIST_SYNC_GUARDS       | sync_guards     | true (on many ranks, one small CPU all_reduce per call: every rank takes the same guard decision) |
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

try:
    import tomllib
except ImportError:  # pragma: no cover - Python 3.10
    tomllib = None  # type: ignore[assignment]

DEFAULT_SOLVER = "ilp"
SCHEDULES = ("1f1b", "gpipe", "interleaved")   # torch.distributed.pipelining's schedules
DDP_FIRST_BUCKET_MB = 1.0   # DDP's first gradient bucket: it closes early so that its all_reduce overlaps the backward
# a device whose measured overlap (DeviceSpec.overlap) is below this hides nothing behind the backward
NO_OVERLAP = 0.05


@dataclass
class Settings:
    solver: str = DEFAULT_SOLVER
    memory_budget: int | None = None
    cache_dir: str | None = None
    mesh_profile: str | None = None
    axis_size: int = 2
    time_limit: float = 60.0
    coalesce: bool = True
    bucket_mb: float = 25.0
    first_bucket_mb: float | None = None   # the first gradient all_reduce bucket; None: auto (resolve_first_bucket); 0: bucket_mb
    shard_bucket_mb: float = 4.0   # parameter all_gathers (metadist_core.gathers) and gradient reduce_scatters per bucket; 0: off
    beam_width: int = 8
    verify_draws: int = 2
    measure_links: bool = True   # measure links and device, time the ops, on the first compile (else defaults)
    max_real_discovery: int = 2 ** 24   # elements: an op no proxy can stand for is discovered at real size below this
    discovery_workers: int = 0   # processes discovering patterns side by side (0: one per core; 1: this one only)
    progress: bool | None = None
    strategy: str = "auto"   # "auto" or a preset of metadist_core.presets (constraints on the same problem)
    grad_compression: str | None = None   # None | "bf16" | "fp16": gradients travel compressed
    micro_batches: int = 1
    pipeline_stages: int | None = None
    schedule: str = "1f1b"
    measure_memory: bool = True   # measure the peak tensor bytes of the first call after each compile
    recompute: bool = True   # recompute forward segments when no plan meets memory_budget without it
    offload: str | None = None   # None | "optimizer": optimizer state and its update on the host (metadist_core.offload)
    ilp_cache_mb: float = 512.0   # disk the ILP's kept answers may take under cache_dir/milp (solvers/_cache.py)
    autotune: bool = True   # with measured costs, time the solver's plan beside the presets' (metadist_core.autotune)
    autotune_seconds: float = 60.0   # autotune's time budget (metadist_core.autotune.time_trials)
    local_time_seconds: float = 10.0   # time a compile may spend timing ops at local shapes (metadist_core.localtime)
    max_replans: int = 8   # re-plans after failed guards before one warning (metadist_core.pipeline.CompiledStep)
    guard_cache: int = 8   # compiled programs kept per call signature (an earlier state that returns reuses its own)
    sync_guards: bool = True   # many ranks agree on every guard decision (one small CPU all_reduce per call)

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)

    @property
    def first_bucket_bytes(self) -> int:
        """Bytes of the first gradient all_reduce bucket: it closes early so its all_reduce overlaps the
        rest of the backward, as DDP's first bucket does."""
        mb = DDP_FIRST_BUCKET_MB if self.first_bucket_mb is None else self.first_bucket_mb
        return int((mb or self.bucket_mb) * 2**20)

    @property
    def shard_bucket_bytes(self) -> int:
        return int(self.shard_bucket_mb * 2**20)

    def solver_options(self) -> dict[str, Any]:
        """The options every solver receives (unknown keys are ignored by a solver)."""
        return {"time_limit": self.time_limit, "beam_width": self.beam_width, "cache_mb": self.ilp_cache_mb}


def check_setting_names(names: Any) -> None:
    """Raise a ValueError naming each of ``names`` that is no setting, with the settings there are."""
    known = {f.name for f in fields(Settings)}
    bad = sorted(set(names) - known)
    if bad:
        raise ValueError(f"unknown setting{'s' if len(bad) > 1 else ''} {', '.join(map(repr, bad))}; "
                         f"the settings are: {', '.join(sorted(known))}")


def _pyproject_settings(start: Path | None = None) -> dict[str, Any]:
    if tomllib is None:
        return {}
    d = (start or Path.cwd()).resolve()
    for folder in (d, *d.parents):
        f = folder / "pyproject.toml"
        if f.is_file():
            try:
                with open(f, "rb") as fh:
                    return dict(tomllib.load(fh).get("tool", {}).get("metadist", {}))
            except (OSError, ValueError) as e:
                raise ValueError(f"cannot read [tool.metadist] from {f}: {e}") from e
    return {}


def load_settings(**explicit: Any) -> Settings:
    """Resolve every setting; ``explicit`` values that are not None win."""
    s = Settings()
    file_vals = _pyproject_settings()
    for f in fields(Settings):
        value = explicit.get(f.name)
        if value is None:
            value = os.environ.get(f"METADIST_{f.name.upper()}")
        if value is None:
            value = file_vals.get(f.name)
        if value is None:
            continue
        if f.name in ("coalesce", "progress", "measure_links", "recompute", "measure_memory", "autotune",
                      "sync_guards"):
            value = _bool(f.name, value)
        elif f.name in ("memory_budget", "axis_size", "beam_width", "verify_draws", "max_real_discovery",
                        "micro_batches", "discovery_workers",
                        "pipeline_stages", "max_replans", "guard_cache"):
            try:
                value = int(float(value))
            except ValueError:
                raise ValueError(f"setting {f.name} must be an integer, got {value!r}") from None
        elif f.name == "first_bucket_mb" and str(value).strip().lower() == "auto":
            value = None
        elif f.name in ("time_limit", "bucket_mb", "first_bucket_mb", "shard_bucket_mb", "ilp_cache_mb",
                        "autotune_seconds", "local_time_seconds"):
            try:
                value = float(value)
            except ValueError:
                raise ValueError(f"setting {f.name} must be a number, got {value!r}") from None
        else:
            value = str(value)
        setattr(s, f.name, value)
    if s.verify_draws < 1:
        raise ValueError(f"verify_draws must be at least 1, got {s.verify_draws}")
    if s.discovery_workers < 0:
        raise ValueError(f"discovery_workers must be 0 (one per core) or more, got {s.discovery_workers}")
    if s.micro_batches < 1:
        raise ValueError(f"micro_batches must be at least 1, got {s.micro_batches}")
    if s.pipeline_stages is not None and s.pipeline_stages < 1:
        raise ValueError(f"pipeline_stages must be None (the planner decides) or at least 1, got {s.pipeline_stages}")
    if s.schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {s.schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if s.strategy != "auto":
        from .presets import check_strategy
        s.strategy = check_strategy(s.strategy)   # an unknown name: ValueError listing the presets
    if s.first_bucket_mb is not None and s.first_bucket_mb < 0:
        raise ValueError(f"first_bucket_mb must be 0 (the same as bucket_mb) or more, got {s.first_bucket_mb}")
    if s.shard_bucket_mb < 0:
        raise ValueError(f"shard_bucket_mb must be 0 (off) or more, got {s.shard_bucket_mb}")
    if s.autotune_seconds <= 0:
        raise ValueError(f"autotune_seconds must be more than 0 (turn autotune off with autotune=False), "
                         f"got {s.autotune_seconds}")
    if s.local_time_seconds < 0:
        raise ValueError(f"local_time_seconds must be 0 (time no op at its local shapes) or more, "
                         f"got {s.local_time_seconds}")
    if s.max_replans < 0:
        raise ValueError(f"max_replans must be 0 or more (re-plans before the warning), got {s.max_replans}")
    if s.guard_cache < 1:
        raise ValueError(f"guard_cache must be at least 1 (compiled programs kept per signature), got {s.guard_cache}")
    if s.axis_size < 2:
        raise ValueError(f"axis_size (discovery) must be at least 2, got {s.axis_size}")
    if s.grad_compression is not None:
        from .compression import compression_dtype
        wire = compression_dtype(s.grad_compression)   # an unknown name: ValueError naming the choices
        s.grad_compression = None if wire is None else {"bfloat16": "bf16", "float16": "fp16"}[wire]
    if s.offload is not None:
        from .offload import check_offload
        s.offload = check_offload(s.offload)   # an unknown name: ValueError naming the choices
        if s.offload and (s.micro_batches > 1 or (s.pipeline_stages or 1) > 1):
            raise ValueError(f"offload={s.offload!r} does not combine with micro_batches={s.micro_batches} or "
                             f"pipeline_stages={s.pipeline_stages} yet; use one or the other")
    return s


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"setting {name} must be true or false (1/0, yes/no, on/off), got {value!r}")


def resolve_first_bucket(s: Settings, overlap: float | None) -> Settings:
    """``s`` with ``first_bucket_mb`` decided when it is auto (None), from the fraction of an asynchronous
    collective the device hides behind compute (``DeviceSpec.overlap``, measured on the live group):

    - where some is hidden (NCCL on a GPU, 2 gloo ranks with cores to spare), DDP's small first bucket
      (:data:`DDP_FIRST_BUCKET_MB`): its all_reduce starts early in the backward and runs beside the rest;
    - where none is (below :data:`NO_OVERLAP`: 4 gloo ranks sharing 2 cores measure 0), no small first
      bucket: it could only add a collective's latency. Measured on that machine, in paired runs of
      ``benchmarks.torch_step``, the steps of the GPT example, GPT-2 and LLaMA got 3-7 % faster.

    A number the user set is kept."""
    if s.first_bucket_mb is not None:
        return s
    hides = overlap is None or overlap >= NO_OVERLAP
    return dataclasses.replace(s, first_bucket_mb=DDP_FIRST_BUCKET_MB if hides else 0.0)

