"""Settings: explicit argument > environment variable ``METADIST_<NAME>`` > ``[tool.metadist]`` in
pyproject.toml > default.

Every setting is a field of :class:`Settings` that carries its own documentation (field metadata
``help``, and ``default`` where the default reads better in words than as a value). The table of all
settings, their environment variables, pyproject keys and defaults is generated from those fields into
docs/configuration.md by ``python scripts/gen_docs.py``; read it there.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

try:
    import tomllib  # type: ignore[import-not-found]  # stdlib from 3.11; mypy checks as 3.10 (the oldest supported)
except ImportError:  # pragma: no cover - Python 3.10
    tomllib = None

DEFAULT_SOLVER = "ilp"
SCHEDULES = ("1f1b", "gpipe", "interleaved")  # torch.distributed.pipelining's schedules
DDP_FIRST_BUCKET_MB = 1.0  # DDP's first gradient bucket: it closes early so that its all_reduce overlaps the backward
# a device whose measured overlap (DeviceSpec.overlap) is below this hides nothing behind the backward
NO_OVERLAP = 0.05
ENV_PREFIX = "METADIST_"


def _setting(default: Any, help: str, *, shown: str | None = None) -> Any:
    """A field of :class:`Settings`: its ``default``, what it does (``help``) and, where the value alone
    would mislead, the default as a user reads it (``shown``)."""
    meta = {"help": help}
    if shown is not None:
        meta["default"] = shown
    return field(default=default, metadata=meta)


PRESETS: tuple[str, ...] = ("ddp", "zero1", "zero2", "zero3", "fsdp", "tp", "tp+dp", "ep", "cp", "zero3+cp", "fsdp+cp")
ALIASES = {"fsdp": "zero3", "fsdp+cp": "zero3+cp"}
STRATEGIES: tuple[str, ...] = ("auto",) + PRESETS


def check_strategy(name: str) -> str:
    """``name`` as a strategy setting ("auto" or a preset); an unknown name is a ValueError listing them."""
    key = str(name).strip().lower()
    if key not in STRATEGIES:
        raise ValueError(
            f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)} "
            f"(fsdp is zero3; a preset is a set of constraints on the same plan search)"
        )
    return key


OFFLOAD_CHOICES = ("optimizer",)


def check_offload(value: Any) -> str | None:
    """``None`` / "none" / "" -> None; "optimizer" -> "optimizer"; anything else: ValueError naming the choices."""
    if value is None or value is False:
        return None
    text = str(value).strip().lower()
    if text in ("", "none", "false", "0", "off"):
        return None
    if text not in OFFLOAD_CHOICES:
        raise ValueError(
            f"unknown offload {value!r}; choose None (keep everything on the device) or "
            f"{' | '.join(repr(c) for c in OFFLOAD_CHOICES)} (optimizer state and update on the host)"
        )
    return text


GRAD_COMPRESSION: dict[str, str] = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}


def compression_dtype(mode: str | None) -> str | None:
    """The canonical wire dtype of a ``grad_compression`` setting (None: no compression).

    Raises ValueError for a name that is not one of None, "none", "bf16", "fp16".
    """
    if mode is None:
        return None
    key = str(mode).strip().lower()
    if key in ("", "none", "off", "false", "0"):
        return None
    if key not in GRAD_COMPRESSION:
        raise ValueError(f"grad_compression must be None, 'bf16' or 'fp16', got {mode!r}")
    return GRAD_COMPRESSION[key]


@dataclass
class Settings:
    solver: str = _setting(
        DEFAULT_SOLVER,
        "The solver that picks the plan: `ilp` (exact: scipy's MILP, HiGHS), `beam` or "
        "`greedy`, or any solver plugin installed (`metadist plugins` lists them).",
    )
    memory_budget: int | None = _setting(
        None,
        "Bytes per device the plan must fit in. Unset: the device's memory less `device_reserve_mb` (on CUDA "
        "the device's own, in `metadist plan` the device preset's); no limit on a CPU.",
        shown="the device's memory (CUDA, device preset); none on a CPU",
    )
    device_reserve_mb: float = _setting(
        2048.0,
        "MiB of a device's memory that the default `memory_budget` leaves for what a plan does not hold: the "
        "CUDA context and kernels (~0.5 GiB), cuBLAS workspaces, NCCL's communicator buffers (~0.2-0.5 GiB a "
        "group) and the caching allocator's slack.",
        shown="2048 (MiB)",
    )
    cache_dir: str | None = _setting(
        None,
        "Where the rule cache, measured mesh profiles and the ILP's kept answers live.",
        shown="the user cache dir (platformdirs)",
    )
    mesh_profile: str | None = _setting(
        None,
        "A mesh profile file (written by `metadist calibrate`) that prices the links between devices.",
        shown="none (built-in defaults, or measured)",
    )
    axis_size: int = _setting(
        2,
        "The axis size `metadist rules` discovers rules on (planning discovers on the mesh's own axis "
        "sizes); at least 2.",
    )
    time_limit: float = _setting(60.0, "Seconds the solver may take.", shown="60 (seconds)")
    collective_timeout: float = _setting(
        600.0,
        "Seconds a collective waits for the other ranks before the job stops with an error that names the "
        "rank that stopped answering; applies to the process groups MetaDist starts (torchrun's environment).",
        shown="600 (seconds)",
    )
    coalesce: bool = _setting(
        True, "Bucket the gradient all-reduces (as DDP does) instead of one collective per gradient."
    )
    bucket_mb: float = _setting(25.0, "MiB per gradient all-reduce bucket.", shown="25 (MiB)")
    first_bucket_mb: float | None = _setting(
        None,
        "MiB of the first gradient bucket, which closes early so that its all-reduce overlaps the rest "
        "of the backward. auto: DDP's 1 MiB where the device is measured to overlap communication with "
        "compute, else `bucket_mb`; 0: the same as `bucket_mb`.",
        shown="auto",
    )
    shard_bucket_mb: float = _setting(
        4.0,
        "MiB per bucket of the parameter all_gathers and gradient reduce_scatters of sharded layouts; "
        "0 turns bucketing them off.",
        shown="4 (MiB)",
    )
    beam_width: int = _setting(8, "Width of the `beam` solver's beam.")
    verify_draws: int = _setting(2, "Random draws that verify each discovered sharding rule; at least 1.")
    measure_links: bool = _setting(
        True,
        "On the first multi-rank compile, measure the links and the device and time the step's ops, "
        "and cache them; off prices with the built-in defaults (plans then do not change with the machine's "
        "load).",
    )
    max_real_discovery: int = _setting(
        2**24,
        "Elements below which an op that no smaller proxy can stand for is discovered at its real size.",
        shown="16777216 (2**24)",
    )
    discovery_workers: int = _setting(
        0,
        "Processes that discover op patterns side by side. 0: one forked process per CPU core (at most 8) "
        "when 12 or more patterns are new and every frontend involved can fork; 1: this process only.",
        shown="0 (one per core)",
    )
    progress: bool | None = _setting(
        None,
        "Show progress bars (tqdm) on stderr: true forces them, false hides them.",
        shown="auto (when stderr is a terminal)",
    )
    strategy: str = _setting(
        "auto",
        "`auto` (the solver plans freely) or a preset: ddp, zero1, zero2, zero3, fsdp (= zero3), tp, "
        "tp+dp, ep (experts split over mesh axis 0), cp and fsdp+cp (= zero3+cp: the sequence split over the last "
        "mesh axis inside causal attention) -- constraints on the same plan search.",
    )
    grad_compression: str | None = _setting(
        None, "Send the collectives on gradients compressed: `bf16` or `fp16`.", shown="none (uncompressed)"
    )
    micro_batches: int = _setting(
        1,
        "Cut the batch (dim 0 of every tensor input) into this many equal parts; gradients accumulate "
        "over them within one call.",
        shown="1 (no accumulation)",
    )
    pipeline_stages: int | None = _setting(
        None,
        "Pipeline stages along mesh axis 0: none lets the planner decide, 1 is no pipeline, k > 1 is "
        "k stages (axis 0 must have size k).",
        shown="none (the planner decides)",
    )
    schedule: str = _setting("1f1b", "The pipeline schedule: `1f1b`, `gpipe` or `interleaved`.")
    measure_memory: bool = _setting(
        True,
        "Measure the peak tensor bytes of the first call after each compile (`step.memory`), beside "
        "the plan's prediction.",
    )
    recompute: bool = _setting(
        True, "Recompute forward segments in the backward when no plan meets `memory_budget` without it (only then)."
    )
    offload: str | None = _setting(
        None,
        "`optimizer`: keep the optimizer state in host memory and run its update on the host CPU.",
        shown="none (everything on the device)",
    )
    ilp_cache_mb: float = _setting(
        512.0,
        "MiB of disk the ILP's kept answers may take under `cache_dir`/milp; the least recently used go first.",
        shown="512 (MiB)",
    )
    autotune: bool = _setting(
        True,
        "With measured costs, time the solver's plan beside the ddp, zero1 and fsdp presets' plans on "
        "the live devices at the first call and keep the fastest (unless a strategy or constraints were "
        "chosen; frontends that can time a plan alone, such as JAX).",
    )
    autotune_seconds: float = _setting(
        60.0,
        "Autotune's time budget: programs not compiled when it is spent are left untimed (never the "
        "solver's plan); more than 0.",
        shown="60 (seconds)",
    )
    local_time_seconds: float = _setting(
        10.0,
        "With measured costs, the time a compile may spend timing matmuls at each strategy's local "
        "shapes, the dearest first; 0 times none and prices every op at its roofline (frontends that time "
        "them: JAX).",
        shown="10 (seconds)",
    )
    max_replans: int = _setting(
        8, "Re-plans of a compiled step after failed guards before one warning says that the loop re-plans every call."
    )
    guard_cache: int = _setting(
        8,
        "Compiled programs kept per call signature, so that an earlier state that returns reuses its own; at least 1.",
    )
    sync_guards: bool = _setting(
        True, "On many ranks, every rank takes the same guard decision (one small CPU all_reduce per call)."
    )
    backend: str = _setting(
        "eager",
        "How each rank runs its program: `eager` (op by op, as lowered), `inductor` (compiled by "
        "torch.compile into fused kernels, collectives included), or any other torch.compile backend name. "
        "Frontends that always compile (JAX) ignore it.",
    )
    moe_capacity_factor: float | None = _setting(
        None,
        "Set: a mixture-of-experts layer runs GShard's capacity-padded dispatch with this many slots per "
        "expert, as a multiple of its even share of the routed tokens; a token past its expert's slots is "
        "dropped. none: the dropless layer (tokens sorted by expert, none dropped, nothing padded).",
        shown="none (dropless)",
    )
    compile_options: dict | None = _setting(
        None,
        "Keyword arguments for torch.compile with a compiled `backend` (`mode`, `options`, `dynamic`...); in "
        'the environment or pyproject as a JSON object, such as `{"mode": "reduce-overhead"}`.',
        shown="none",
    )

    @property
    def compiles(self) -> bool:
        """Does a compiler run the rank program (a ``backend`` other than eager)?"""
        return self.backend != "eager"

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
        raise ValueError(
            f"unknown setting{'s' if len(bad) > 1 else ''} {', '.join(map(repr, bad))}; "
            f"the settings are: {', '.join(sorted(known))}"
        )


def env_var(name: str) -> str:
    """The environment variable of setting ``name``: ``METADIST_<NAME>``."""
    return f"{ENV_PREFIX}{name.upper()}"


def plain_default(value: Any) -> str:
    """``value`` as one would write it in pyproject.toml or the environment (None: ``none``)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def default_text(f: dataclasses.Field) -> str:
    """The default of the Settings field ``f`` as a user reads it: its ``default`` metadata (which starts
    with the plain value where there is one), else the plain value."""
    shown = f.metadata.get("default")
    return plain_default(f.default) if shown is None else shown


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
            value = os.environ.get(env_var(f.name))
        if value is None:
            value = file_vals.get(f.name)
        if value is None:
            continue
        if f.name in (
            "coalesce",
            "progress",
            "measure_links",
            "recompute",
            "measure_memory",
            "autotune",
            "sync_guards",
        ):
            value = _bool(f.name, value)
        elif f.name in (
            "memory_budget",
            "axis_size",
            "beam_width",
            "verify_draws",
            "max_real_discovery",
            "micro_batches",
            "discovery_workers",
            "pipeline_stages",
            "max_replans",
            "guard_cache",
        ):
            try:
                value = int(float(value))
            except ValueError:
                raise ValueError(f"setting {f.name} must be an integer, got {value!r}") from None
        elif f.name == "first_bucket_mb" and str(value).strip().lower() == "auto":
            value = None
        elif f.name == "moe_capacity_factor" and str(value).strip().lower() in ("none", ""):
            value = None
        elif f.name == "compile_options":
            value = _options(value)
        elif f.name in (
            "time_limit",
            "collective_timeout",
            "bucket_mb",
            "first_bucket_mb",
            "moe_capacity_factor",
            "shard_bucket_mb",
            "ilp_cache_mb",
            "autotune_seconds",
            "local_time_seconds",
            "device_reserve_mb",
        ):
            try:
                value = float(value)
            except ValueError:
                raise ValueError(f"setting {f.name} must be a number, got {value!r}") from None
        else:
            value = str(value)
        setattr(s, f.name, value)
    if s.verify_draws < 1:
        raise ValueError(f"verify_draws must be at least 1, got {s.verify_draws}")
    if not s.collective_timeout > 0:
        raise ValueError(f"collective_timeout must be a positive number of seconds, got {s.collective_timeout}")
    if s.discovery_workers < 0:
        raise ValueError(f"discovery_workers must be 0 (one per core) or more, got {s.discovery_workers}")
    if s.micro_batches < 1:
        raise ValueError(f"micro_batches must be at least 1, got {s.micro_batches}")
    if s.pipeline_stages is not None and s.pipeline_stages < 1:
        raise ValueError(f"pipeline_stages must be None (the planner decides) or at least 1, got {s.pipeline_stages}")
    if s.schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {s.schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if s.strategy != "auto":
        s.strategy = check_strategy(s.strategy)  # an unknown name: ValueError listing the presets
    if s.first_bucket_mb is not None and s.first_bucket_mb < 0:
        raise ValueError(f"first_bucket_mb must be 0 (the same as bucket_mb) or more, got {s.first_bucket_mb}")
    if s.moe_capacity_factor is not None and not s.moe_capacity_factor > 0:
        raise ValueError(
            f"moe_capacity_factor must be None (no token dropped) or a positive number, got {s.moe_capacity_factor}"
        )
    if s.shard_bucket_mb < 0:
        raise ValueError(f"shard_bucket_mb must be 0 (off) or more, got {s.shard_bucket_mb}")
    if s.autotune_seconds <= 0:
        raise ValueError(
            f"autotune_seconds must be more than 0 (turn autotune off with autotune=False), got {s.autotune_seconds}"
        )
    if s.local_time_seconds < 0:
        raise ValueError(
            f"local_time_seconds must be 0 (time no op at its local shapes) or more, got {s.local_time_seconds}"
        )
    if not s.device_reserve_mb >= 0:
        raise ValueError(f"device_reserve_mb must be 0 or more (MiB), got {s.device_reserve_mb}")
    if s.max_replans < 0:
        raise ValueError(f"max_replans must be 0 or more (re-plans before the warning), got {s.max_replans}")
    if s.guard_cache < 1:
        raise ValueError(f"guard_cache must be at least 1 (compiled programs kept per signature), got {s.guard_cache}")
    s.backend = str(s.backend).strip() or "eager"
    if s.axis_size < 2:
        raise ValueError(f"axis_size (discovery) must be at least 2, got {s.axis_size}")
    if s.grad_compression is not None:
        wire = compression_dtype(s.grad_compression)  # an unknown name: ValueError naming the choices
        s.grad_compression = None if wire is None else {"bfloat16": "bf16", "float16": "fp16"}[wire]
    if s.offload is not None:
        s.offload = check_offload(s.offload)  # an unknown name: ValueError naming the choices
        if s.offload and (s.micro_batches > 1 or (s.pipeline_stages or 1) > 1):
            raise ValueError(
                f"offload={s.offload!r} does not combine with micro_batches={s.micro_batches} or "
                f"pipeline_stages={s.pipeline_stages} yet; use one or the other"
            )
    return s


def _options(value: Any) -> dict:
    """A ``compile_options`` value: a dict, or a JSON object in text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"setting compile_options must be a JSON object, got {value!r}: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"setting compile_options must be a dict of torch.compile keywords, got {value!r}")
    return dict(value)


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
