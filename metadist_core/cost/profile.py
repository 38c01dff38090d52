"""Mesh profiles: nodes, devices per node and link cost (alpha, beta) per link level.

A profile is the measured successor of a resource spec: ``metadist calibrate``
times real collectives and writes one (see ``metadist_torch.measure.calibrate``), and
:func:`load_profile` reads it from a path or ``$METADIST_MESH_PROFILE``, or
falls back to :data:`DEFAULT_PROFILE`. :meth:`MeshProfile.mesh` gives a Mesh
whose per-axis alpha/beta come from the level each axis's groups cross.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from metadist_core import cachefiles
from metadist_core.cost.model import DeviceSpec, DEVICE_PRESETS
from metadist_core.ir.mesh import DEFAULT_ALPHA, DEFAULT_BETA, Mesh
from metadist_core.config import load_settings
import socket
from metadist_core.discovery.rules import default_cache_dir

PROFILE_ENV = "METADIST_MESH_PROFILE"
FORMAT = "metadist.MeshProfile/1"


@dataclass
class MeshProfile:
    """Devices ``nodes x devices_per_node``; ``levels['intra']`` and ``levels['inter']`` hold alpha (s) and beta (s/byte)."""

    nodes: int = 1
    devices_per_node: int = 8
    levels: dict = field(
        default_factory=lambda: {
            "intra": {"alpha": DEFAULT_ALPHA, "beta": DEFAULT_BETA},
            "inter": {"alpha": 3 * DEFAULT_ALPHA, "beta": 2 * DEFAULT_BETA},
        }
    )
    backend: str = "default"
    measured: bool = False
    device: DeviceSpec = field(default_factory=lambda: DEVICE_PRESETS["cpu"])
    samples: list = field(default_factory=list)  # raw timings: level, collective, n, bytes, seconds
    # "2x2" -> [{"alpha", "beta", "kinds": {kind: {"alpha", "beta"}}} per axis], measured on that mesh; "kinds"
    # (optional): collective kinds timed apart from the all_reduces (Mesh.links)
    axis_costs: dict = field(default_factory=dict)
    key: dict = field(default_factory=dict)  # host, world_size, device_kind it was measured for

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def axis_level(self, shape: Sequence[int], axis: int) -> str:
        """'intra' when every group along ``axis`` stays inside one node (row-major ranks), else 'inter'."""
        stride = math.prod(shape[axis + 1 :])
        return "intra" if stride * shape[axis] <= self.devices_per_node else "inter"

    def covers(self, mesh: Mesh | Sequence[int]) -> bool:
        """Were the links of ``mesh`` (a Mesh or its shape) measured on this very mesh shape?"""
        shape = mesh.shape if isinstance(mesh, Mesh) else tuple(mesh)
        return "x".join(map(str, shape)) in self.axis_costs

    def mesh(self, shape: Sequence[int], axis_names: Sequence[str] | None = None) -> Mesh:
        """A Mesh of ``shape`` with per-axis alpha/beta from this profile."""
        shape = tuple(int(s) for s in shape)
        measured = self.axis_costs.get("x".join(map(str, shape)))
        if measured and len(measured) == len(shape):  # measured on this very mesh, axis by axis
            links = [
                {k: (float(v["alpha"]), float(v["beta"])) for k, v in a.get("kinds", {}).items()} for a in measured
            ]  # collective kinds timed apart (metadist_torch.measure.calibrate)
            return Mesh(
                shape,
                axis_names,
                [float(a["alpha"]) for a in measured],
                [float(a["beta"]) for a in measured],
                links if any(links) else None,
            )
        levels = [self.axis_level(shape, a) for a in range(len(shape))]
        return Mesh(
            shape, axis_names, [self.levels[lv]["alpha"] for lv in levels], [self.levels[lv]["beta"] for lv in levels]
        )

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "nodes": self.nodes,
            "devices_per_node": self.devices_per_node,
            "levels": self.levels,
            "backend": self.backend,
            "measured": self.measured,
            "device": self.device.to_json(),
            "samples": self.samples,
            **({"axis_costs": self.axis_costs} if self.axis_costs else {}),
            **({"key": self.key} if self.key else {}),
        }

    @classmethod
    def from_json(cls, d: dict) -> "MeshProfile":
        if d.get("format") != FORMAT:
            raise ValueError(f"not a mesh profile (format {d.get('format')!r}, expected {FORMAT!r})")
        for lv in ("intra", "inter"):
            if lv not in d["levels"] or not {"alpha", "beta"} <= set(d["levels"][lv]):
                raise ValueError(f"mesh profile needs levels.{lv}.alpha and .beta; got {d['levels'].get(lv)}")
        return cls(
            int(d["nodes"]),
            int(d["devices_per_node"]),
            d["levels"],
            d.get("backend", "?"),
            bool(d.get("measured", False)),
            DeviceSpec.from_json(d["device"]) if "device" in d else DEVICE_PRESETS["cpu"],
            list(d.get("samples", [])),
            dict(d.get("axis_costs", {})),
            dict(d.get("key", {})),
        )

    def dumps(self) -> str:
        """The profile as the JSON text a profile file holds."""
        return json.dumps(self.to_json(), indent=1)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the profile to ``path`` atomically (a file the user asked for: errors raise); the path."""
        return cachefiles.replace_atomic(path, self.dumps())


DEFAULT_PROFILE = MeshProfile()


def load_profile(path: str | os.PathLike | None = None) -> MeshProfile:
    """The profile at ``path``, else at the ``mesh_profile`` setting (``$METADIST_MESH_PROFILE``), else the defaults."""
    if not path:
        path = load_settings().mesh_profile
    src = path
    if not src:
        return MeshProfile()
    p = Path(src)
    if not p.exists():
        raise FileNotFoundError(
            f"mesh profile {p} does not exist (the mesh_profile setting or {PROFILE_ENV}); "
            f"write one with `metadist calibrate --out {p}` or unset {PROFILE_ENV}"
        )
    return MeshProfile.from_json(json.loads(p.read_text()))


# -- fitting (framework-neutral half of calibrate) ------------------------------


def collective_factors(kind: str, n: int) -> tuple[float, float]:
    """(latency steps, byte factor) of the ring model used in cost.py for ``kind`` on ``n`` devices."""
    if kind == "all_reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return float(n - 1), (n - 1) / n
    if kind == "send_recv":
        return 1.0, 1.0
    raise ValueError(f"no ring model for {kind!r}")


def fit_alpha_beta(samples: Sequence[tuple[str, int, float, float]]) -> tuple[float, float]:
    """Least-squares (alpha, beta) >= 0 from ``(kind, n, nbytes, seconds)`` samples."""
    if not samples:
        raise ValueError("no timings to fit alpha and beta from")
    A = np.array([[collective_factors(k, n)[0], collective_factors(k, n)[1] * b] for k, n, b, _ in samples])
    y = np.array([s for *_, s in samples])
    from scipy.optimize import nnls

    w = 1.0 / np.maximum(y, 1e-9)  # relative error: small messages count as much as big ones
    coef, _ = nnls(A * w[:, None], y * w)
    alpha, beta = float(coef[0]), float(coef[1])
    return max(alpha, 1e-9), max(beta, 1e-15)


def profile_from_samples(
    samples: Sequence[dict], nodes: int, devices_per_node: int, backend: str, device: DeviceSpec | None = None
) -> MeshProfile:
    """A measured profile from raw samples (dicts with level, kind, n, nbytes, seconds)."""
    levels = {}
    for lv in ("intra", "inter"):
        rows = [(s["kind"], s["n"], s["nbytes"], s["seconds"]) for s in samples if s["level"] == lv]
        if rows:
            a, b = fit_alpha_beta(rows)
            levels[lv] = {"alpha": a, "beta": b}
    if "intra" not in levels:
        levels["intra"] = dict(DEFAULT_PROFILE.levels["intra"])
    if "inter" not in levels:  # single node: crossing nodes never happens; keep a pessimistic guess
        levels["inter"] = {"alpha": 3 * levels["intra"]["alpha"], "beta": 2 * levels["intra"]["beta"]}
    return MeshProfile(nodes, devices_per_node, levels, backend, True, device or DEVICE_PRESETS["cpu"], list(samples))


# -- measured by default: the profile cache ---------------------------------------

#: bumped when the way a profile is measured changes: older cached profiles are measured again
#: (2: messages up to 16 MiB, so that bandwidth shows beside the latency; 3: device rates measured by all
#: ranks at once; 4: the memory rate by bytes moved, DeviceSpec.mem_curve; 5: how much of an asynchronous
#: collective the compute beside it hides, DeviceSpec.overlap; 6: the rates of one rank alone divided by
#: the share of the device a rank gets while all compute, the per-op dispatch of a lowered program)
MEASURE_VERSION = 6


def profile_key(world_size: int, device_kind: str, host: str | None = None) -> dict:
    """What a measured profile is valid for: this host, this world size, this kind of device, this
    way of measuring (:data:`MEASURE_VERSION`)."""
    return {
        "host": host or socket.gethostname(),
        "world_size": int(world_size),
        "device_kind": str(device_kind),
        "measure": MEASURE_VERSION,
    }


#: the cache dir's folder of measured profiles and the files kept beside them
PROFILES = "profiles"


def profile_cache_path(cache_dir: str | os.PathLike | None, key: dict) -> Path:
    """``<cache dir>/profiles/<host>-w<world size>-<device kind>.json``."""
    base = Path(cache_dir) if cache_dir else Path(default_cache_dir())
    safe = "".join(
        ch if ch.isalnum() or ch in "-_." else "_" for ch in f"{key['host']}-w{key['world_size']}-{key['device_kind']}"
    )
    return base / PROFILES / f"{safe}.json"


def cache_dir_of(path: str | os.PathLike) -> Path:
    """The cache dir a file lies in: the parent of its folder when that is the profiles' folder (a profile
    and the files beside it), else its folder."""
    folder = Path(path).parent
    return folder.parent if folder.name == PROFILES else folder


def beside_profile(cache_dir: str | os.PathLike | None, key: dict, suffix: str) -> Path:
    """A file kept beside the cached profile of ``key``: ``<profile file's stem><suffix>`` (``-ops.json``:
    the ops' slowdowns; ``-local.json``: ops timed at local shapes)."""
    where = profile_cache_path(cache_dir, key)
    return where.with_name(where.stem + suffix)


def cached_profile(cache_dir: str | os.PathLike | None, key: dict) -> MeshProfile | None:
    """The measured profile cached for ``key``, or None (none yet, unreadable, or measured for another key)."""
    p = profile_cache_path(cache_dir, key)
    prof = cachefiles.read(p, lambda raw: MeshProfile.from_json(json.loads(raw)), "mesh profile")
    return prof if prof is not None and prof.measured and prof.key == key else None


def profile_for(frontend, resolved, settings, *, force: bool = False) -> MeshProfile:
    """The profile a compile on ``resolved`` (a :class:`~metadist_core.driver.frontend.Resolved`) prices with.

    The ``mesh_profile`` setting overrides everything. Otherwise, on a mesh of
    more than one device whose frontend can measure (``resolved.device_kind``
    not None), the profile measured on this machine is read from the cache dir
    (keyed by host, world size and device kind), and measured on the live engine
    (``frontend.measure_profile``) and cached when there is none or ``force``.
    A frontend that cannot measure gets the built-in defaults.
    """
    if settings.mesh_profile:
        return load_profile(settings.mesh_profile)
    if not getattr(settings, "measure_links", True) and not force:
        return MeshProfile()  # the built-in defaults: plans that do not change with this machine's load
    mesh = resolved.mesh
    kind = resolved.device_kind if mesh.size > 1 else None
    if kind is None:
        return MeshProfile()
    key = profile_key(mesh.size, kind)
    cached = None if force else cached_profile(settings.cache_dir, key)
    prof = frontend.measure_profile(resolved, cached)
    if prof is None:
        return MeshProfile()
    if prof is not cached:
        prof.key = key
        if resolved.lead:
            keep_profile(prof, settings.cache_dir, key)
    return prof


def keep_profile(prof: MeshProfile, cache_dir: str | os.PathLike | None, key: dict) -> bool:
    """Cache ``prof`` as the profile measured for ``key``, keeping the mesh shapes that another job measured
    into the file meanwhile (its lock held); False when the cache dir cannot be written (one warning: the
    next run measures again)."""
    where = profile_cache_path(cache_dir, key)
    with cachefiles.exclusive(where):
        disk = cached_profile(cache_dir, key)
        if disk is not None:
            prof = dataclasses.replace(prof, axis_costs={**disk.axis_costs, **prof.axis_costs})
        return cachefiles.write_atomic(where, prof.dumps(), cache_dir=cache_dir_of(where), what="mesh profile")
