"""JAX step time: MetaDist against hand-written data parallelism and against GSPMD, on 8 virtual CPU devices.

    python -m benchmarks.jax_step [--quick]

For each model (the MLP and the flax transformer of examples/jax, trained with
optax adam) and mesh ((8,) and (2, 4)), one run times three ways to run the
same step on the same 8 devices:

* ``metadist``: ``metadist_compile`` — the plan lowered to shard_map with its
  collectives placed explicitly;
* ``hand-dp``: ``jax.jit`` with hand-written data-parallel shardings
  (parameters and optimizer state replicated, the batch split on every axis);
* ``gspmd``: ``jax.jit`` given MetaDist's in/out shardings
  (``step.shardings()``), leaving everything in between to GSPMD;
* ``metadist-calibrated``: MetaDist planning with link costs measured on
  this machine first (:mod:`metadist_jax.calibrate`) instead of the defaults.

Step times are medians over several runs after a warm-up; ratios are taken in
the same run. The devices are virtual CPU devices on one host, so these figures
measure the programs' structure and collective count, not network links.
"""
from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import logging  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from ._common import timed, write_results  # noqa: E402

NAME = "jax_step"
EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples" / "jax"
MESHES = [(8,), (2, 4)]


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"metadist_example_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def models(quick: bool):
    """(name, step_fn, params, opt_state, batch, memory_budget) per model."""
    import jax
    import optax

    mlp = _example("mlp")
    tf = _example("transformer")
    opt = optax.adam(1e-3)
    if quick:
        sizes, mb = mlp.TEST_SIZES, dict(mlp.TEST_BATCH)
        cfg, tb = tf.TEST_CONFIG, 8
    else:
        sizes, mb = (256, 1024, 1024, 64), {"batch": 256, "features": 256, "classes": 64}
        cfg, tb = tf.Config(vocab=256, width=128, heads=4, layers=2, hidden=512, seq=32), 32
    p = mlp.init_params(jax.random.key(0), sizes)
    yield f"mlp {'x'.join(map(str, sizes))}", mlp.make_step(opt), p, opt.init(p), mlp.make_batch(0, **mb)
    model, p = tf.init(cfg)
    yield (f"transformer w{cfg.width} L{cfg.layers}", tf.make_step(model, opt), p, opt.init(p),
           tf.make_batch(0, cfg, batch=tb))


def _block(out):
    import jax
    jax.block_until_ready(out)
    return out


def run(quick: bool, solver: str | None) -> list[dict]:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from metadist_jax import metadist_compile

    if jax.device_count() != 8:
        raise SystemExit(f"this benchmark needs 8 JAX devices, got {jax.device_count()}")
    from metadist_jax.calibrate import measure_profile

    repeats = 5 if quick else 20
    profile = measure_profile(iters=3 if quick else 7)
    print(f"measured links: alpha {profile.levels['intra']['alpha'] * 1e6:.1f} us, "
          f"{1e-9 / profile.levels['intra']['beta']:.2f} GB/s", flush=True)
    records = []
    for name, step_fn, params, opt_state, batch in models(quick):
        for mesh in MESHES:
            t0 = time.perf_counter()
            md = metadist_compile(step_fn, mesh=mesh, solver=solver)
            args = md.place(params, opt_state, batch)
            _block(md(*args))
            compile_s = time.perf_counter() - t0
            jmesh = md.jax_mesh
            every_axis = tuple(jmesh.axis_names)

            rep = NamedSharding(jmesh, P())
            split = NamedSharding(jmesh, P(every_axis))
            dp_in = (jax.tree.map(lambda _: rep, params), jax.tree.map(lambda _: rep, opt_state),
                     jax.tree.map(lambda _: split, batch))
            dp_out = (rep, dp_in[0], dp_in[1])
            hand = jax.jit(step_fn, in_shardings=dp_in, out_shardings=dp_out)
            hand_args = [jax.device_put(a, s) for a, s in zip((params, opt_state, batch), dp_in)]

            ins, outs = md.shardings()
            gspmd = jax.jit(step_fn, in_shardings=ins[0], out_shardings=outs)

            cal = metadist_compile(step_fn, mesh=profile.mesh(mesh), solver=solver)
            cal_args = cal.place(params, opt_state, batch)
            _block(cal(*cal_args))

            systems = {"metadist": (md, args), "hand-dp": (hand, hand_args), "gspmd": (gspmd, args),
                       "metadist-calibrated": (cal, cal_args)}
            times = {}
            for sys_name, (fn, a) in systems.items():
                times[sys_name], _ = timed(lambda: _block(fn(*a)), repeats=repeats, warmup=2)
            n_params = sum(1 for v in md.graph.inputs if md.graph.vars[v].role == "parameter")
            for sys_name, t in times.items():
                own = cal if sys_name == "metadist-calibrated" else md
                plan = own.plan
                sharded = sum(1 for v in own.graph.inputs if own.graph.vars[v].role == "parameter"
                              and not plan.input_shardings[v].is_fully_replicated())
                mine = sys_name.startswith("metadist")
                records.append({
                    "model": name, "mesh": "x".join(map(str, mesh)), "system": sys_name,
                    "step_ms": t * 1e3, "vs_metadist": t / times["metadist"],
                    "params_sharded": f"{sharded}/{n_params}" if sys_name != "hand-dp" else f"0/{n_params}",
                    "plan_ms_model": plan.objective * 1e3 if mine else None,
                    "collectives": sum(1 for _, c in plan.collectives() if not c.is_free) if mine else None,
                    "compile_s": compile_s if sys_name == "metadist" else None,
                    "solver": plan.solver, "quick": quick,
                })
            print(f"{name:>26} mesh {'x'.join(map(str, mesh)):>3}: " +
                  ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in times.items()) +
                  f" (compile {compile_s:.1f} s)", flush=True)
    return records


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small models, few repeats (< 2 minutes)")
    ap.add_argument("--solver", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("METADIST_PROGRESS", "0")
    records = run(args.quick, args.solver)
    notes = ("Step time of one training step (forward, backward, adam) on 8 virtual CPU devices of one host. "
             "`metadist`: the plan lowered to shard_map with explicit collectives; `hand-dp`: jax.jit with "
             "replicated parameters and the batch split over every device; `gspmd`: jax.jit given MetaDist's "
             "in/out shardings, GSPMD choosing the rest; `metadist-calibrated`: MetaDist planning with link costs "
             "measured on this machine. `vs_metadist` > 1 means slower than MetaDist. "
             "Virtual devices share the host's cores, so these measure program structure, not links.")
    path = write_results(NAME, records, ["model", "mesh", "system", "step_ms", "vs_metadist", "params_sharded",
                                         "collectives", "plan_ms_model", "compile_s", "solver"],
                         "JAX step time: MetaDist vs hand-written DP vs GSPMD (8 virtual CPU devices)", notes)
    print(f"wrote {path} and {path.with_suffix('.json')}")


if __name__ == "__main__":
    main()
