"""JAX step time: MetaDist against hand-written data parallelism and against GSPMD, on 8 virtual CPU devices.

    python -m benchmarks.jax_step [--quick]

For each model (the MLP and the flax transformer of examples/jax, trained with
optax adam) and mesh ((8,) and (2, 4)), one run times three ways to run the
same step on the same 8 devices:

* ``metadist``: ``metadist_compile`` with its defaults — the plan lowered to
  shard_map with its collectives placed explicitly; with measured costs the
  solver's plan is timed beside the ddp, zero1 and fsdp presets' at the first call, each
  lowered as a shard_map and twice through GSPMD (:mod:`metadist_jax.gspmd`: the
  plan's layouts held, or only its input and output layouts: ``gspmd-io``), and the
  fastest kept (``autotune``, :mod:`metadist_core.driver.autotune`);
* ``metadist-model``: the same with ``autotune=False``: the solver's plan as the
  cost model ranks it;
* ``hand-dp``: ``jax.jit`` with hand-written data-parallel shardings
  (parameters and optimizer state replicated, the batch split on every axis);
* ``gspmd``: ``jax.jit`` given the in/out shardings of the solver's plan
  (``metadist-model``'s ``step.shardings()``), leaving everything in between to GSPMD;
* ``metadist-builtin``: MetaDist with the built-in link and device costs
  instead of those its first compile measures on this machine (the default);
* ``metadist-ddp``: MetaDist pinned to data parallelism, to tell a wrong
  choice from a slow lowering; its price is hand-dp's prediction.

Beside each time: the cost model's prediction for that plan and the bytes per
device its collectives move, priced and counted in the HLO XLA compiled.

Writes results/jax_step.json, .md and .png (each plan's prediction against its
measured step). Step times are medians over interleaved rounds after a warm-up (one step of
every system per round, in Williams orders, as torch_step times them), so the
ratios are taken in the same rounds. The devices are virtual CPU devices on one host, so these figures
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
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from unittest import mock  # noqa: E402


from ._common import RESULTS, interleaved, plot_predicted, write_results  # noqa: E402

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
    yield (
        f"transformer w{cfg.width} L{cfg.layers}",
        tf.make_step(model, opt),
        p,
        opt.init(p),
        tf.make_batch(0, cfg, batch=tb),
    )


def _block(out):
    import jax

    jax.block_until_ready(out)
    return out


def _compile(step_fn, params, opt_state, batch, **kw):
    """A MetaDist step compiled and run once; (step, its placed arguments, seconds)."""
    from metadist_jax import metadist_compile

    t0 = time.perf_counter()
    st = metadist_compile(step_fn, **kw)
    a = st.place(params, opt_state, batch)
    _block(st(*a))
    return st, a, time.perf_counter() - t0


def _kept(plan) -> str | None:
    """The plan and lowering autotune kept, as ``preset/lowering`` (None: nothing was timed)."""
    fig = plan.stats.autotune
    return None if not fig else f"{fig['chosen']}/{fig.get('lowering') or '-'}"


def run(quick: bool, solver: str | None, cache: str) -> list[dict]:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from metadist_core.plan.overlap import predict
    from metadist_jax.hlo import counted_bytes

    if jax.device_count() != 8:
        raise SystemExit(f"this benchmark needs 8 JAX devices, got {jax.device_count()}")
    repeats = 5 if quick else 20
    records = []
    for name, step_fn, params, opt_state, batch in models(quick):
        for mesh in MESHES:
            common = dict(mesh=mesh, solver=solver, cache_dir=cache)
            # the first compile on this machine measures the links and the device (cached in ``cache``)
            md, args, compile_s = _compile(step_fn, params, opt_state, batch, **common)
            mo, mo_args, _ = _compile(step_fn, params, opt_state, batch, autotune=False, **common)
            with mock.patch.dict(os.environ, {"METADIST_MEASURE_LINKS": "0"}):  # the built-in costs
                bi, bi_args, _ = _compile(step_fn, params, opt_state, batch, **common)
            dd, dd_args, _ = _compile(step_fn, params, opt_state, batch, strategy="ddp", **common)
            links = md.problem.mesh
            print(
                f"{name} mesh {mesh}: measured alpha {[f'{a * 1e6:.1f} us' for a in links.alpha]}, "
                f"{[f'{1e-9 / b:.2f} GB/s' for b in links.beta]}, device "
                f"{md.problem.device.peak_flops / 1e9:.1f} GFLOP/s",
                flush=True,
            )
            jmesh = md.jax_mesh
            every_axis = tuple(jmesh.axis_names)
            rep = NamedSharding(jmesh, P())
            split = NamedSharding(jmesh, P(every_axis))
            dp_in = (
                jax.tree.map(lambda _: rep, params),
                jax.tree.map(lambda _: rep, opt_state),
                jax.tree.map(lambda _: split, batch),
            )
            dp_out = (rep, dp_in[0], dp_in[1])
            hand = jax.jit(step_fn, in_shardings=dp_in, out_shardings=dp_out)
            hand_args = [jax.device_put(a, s) for a, s in zip((params, opt_state, batch), dp_in)]
            ins, outs = mo.shardings()
            gspmd = jax.jit(step_fn, in_shardings=ins[0], out_shardings=outs)

            steps = {"metadist": md, "metadist-model": mo, "metadist-builtin": bi, "metadist-ddp": dd}
            systems = {
                "metadist": (md, args),
                "metadist-model": (mo, mo_args),
                "metadist-builtin": (bi, bi_args),
                "metadist-ddp": (dd, dd_args),
                "hand-dp": (hand, hand_args),
                "gspmd": (gspmd, mo_args),
            }
            for fn, a in systems.values():  # compiled and warm before any timing
                for _ in range(2):
                    _block(fn(*a))
            # interleaved rounds in Williams orders (as torch_step): a slow spell of the shared cores falls on
            # every system alike, and the ratios are taken in the same rounds
            rounds = -(-repeats // len(systems)) * len(systems)
            per = interleaved({k: (lambda i, fn=fn, a=a: _block(fn(*a))) for k, (fn, a) in systems.items()}, rounds)
            times = {k: statistics.median(v) for k, v in per.items()}
            preds = {k: predict(st.plan, st.problem) for k, st in steps.items()}
            preds["hand-dp"] = preds["metadist-ddp"]  # the hand layout, priced by MetaDist pinned to it
            counted = {k: counted_bytes(st.lowered().compiled_text(*systems[k][1])) for k, st in steps.items()}
            counted["hand-dp"] = counted_bytes(hand.lower(*hand_args).compile().as_text())
            counted["gspmd"] = counted_bytes(gspmd.lower(*mo_args).compile().as_text())
            n_params = sum(1 for v in md.graph.inputs if md.graph.vars[v].role == "parameter")
            best = min(times["hand-dp"], times["gspmd"])
            for sys_name, t in times.items():
                own = steps.get(sys_name, mo if sys_name == "gspmd" else md)
                plan = own.plan
                sharded = sum(
                    1
                    for v in own.graph.inputs
                    if own.graph.vars[v].role == "parameter" and not plan.input_shardings[v].is_fully_replicated()
                )
                pr = preds.get(sys_name)
                records.append(
                    {
                        "model": name,
                        "mesh": "x".join(map(str, mesh)),
                        "system": sys_name,
                        "step_ms": t * 1e3,
                        "vs_metadist": t / times["metadist"],
                        "vs_best_hand": t / best,
                        "predicted_ms": pr.step * 1e3 if pr else None,
                        "pred_error": (pr.step - t) / t if pr else None,
                        "comm_bytes_predicted": pr.comm_bytes if pr else None,
                        "comm_bytes_counted": counted[sys_name][0],
                        "collectives_counted": counted[sys_name][1],
                        "params_sharded": f"{sharded}/{n_params}" if sys_name != "hand-dp" else f"0/{n_params}",
                        "compile_s": compile_s if sys_name == "metadist" else None,
                        "solver": plan.solver,
                        "quick": quick,
                        "autotune": _kept(plan) if sys_name == "metadist" else None,
                        "autotune_trials": plan.stats.autotune if sys_name == "metadist" else None,
                    }
                )
            print(
                f"{name:>26} mesh {'x'.join(map(str, mesh)):>3}: "
                + ", ".join(
                    f"{k} {v * 1e3:.2f} ms" + (f" (pred {preds[k].step * 1e3:.2f})" if k in preds else "")
                    for k, v in times.items()
                )
                + f" (compile {compile_s:.1f} s; autotune kept "
                f"{_kept(md.plan)})",
                flush=True,
            )
    return records


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small models, few repeats (< 2 minutes)")
    ap.add_argument("--solver", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("METADIST_PROGRESS", "0")
    import tempfile

    with tempfile.TemporaryDirectory(prefix="metadist-jax-step-") as cache:
        records = run(args.quick, args.solver, cache)
    notes = (
        "Step time of one training step (forward, backward, adam) on 8 virtual CPU devices of one host, "
        "medians over 24 interleaved rounds (one step of each system per round, Williams orders), all systems in "
        "the same run. `metadist`: MetaDist's defaults: the plan lowered to shard_map "
        "with explicit collectives, priced with the link and device costs its first compile measured on "
        "this machine, the solver's plan timed beside the ddp, zero1 and fsdp presets' plans at the first call, each "
        "lowered as a shard_map and through GSPMD (`gspmd`: its layouts held by sharding constraints, XLA "
        "placing the collectives; `gspmd-io`: only its input and output layouts held), and the fastest kept (`autotune` column: the plan and lowering kept; "
        "for a GSPMD lowering the counted bytes are XLA's, the predicted ones the plan's); `metadist-model`: the same with "
        "`autotune=False`, the solver's plan as the cost model ranks it; `metadist-builtin`: the same with the built-in costs; `metadist-ddp`: MetaDist "
        'pinned to data parallelism (`strategy="ddp"`), whose price stands as hand-dp\'s prediction; '
        "`hand-dp`: jax.jit with replicated parameters and the batch split over every device; `gspmd`: "
        "jax.jit given metadist-model's in/out shardings, GSPMD choosing the rest (no prediction). "
        "`predicted_ms`: metadist_core.plan.overlap.predict of the plan; `comm_bytes_predicted`: the bytes per "
        "device its collectives move as priced; `comm_bytes_counted`: the same read from the optimized HLO "
        "XLA compiled (metadist_jax.hlo). `vs_best_hand` < 1 means faster than the better of hand-dp and "
        "gspmd. Virtual devices share the host's 2 cores, so these measure program structure, not links."
    )
    path = write_results(
        NAME,
        records,
        [
            "model",
            "mesh",
            "system",
            "step_ms",
            "predicted_ms",
            "pred_error",
            "vs_best_hand",
            "comm_bytes_predicted",
            "comm_bytes_counted",
            "collectives_counted",
            "params_sharded",
            "autotune",
            "compile_s",
        ],
        "JAX step time: MetaDist vs hand-written DP vs GSPMD (8 virtual CPU devices)",
        notes,
    )
    plot(records, RESULTS / f"{NAME}.png")
    print(f"wrote {path}, {path.with_suffix('.json')} and {NAME}.png")


def plot(records, path: pathlib.Path) -> None:
    """Predicted against measured for every plan with a prediction (the GSPMD row has none)."""
    short = {"mlp": "mlp", "transformer": "tf"}
    plot_predicted(
        records,
        path,
        "jax_step: predicted against measured, 8 virtual CPU devices",
        lambda r: f"{short.get(r['model'].split()[0], r['model'])} {r['mesh']}/{r['system']}",
    )


if __name__ == "__main__":
    main()
