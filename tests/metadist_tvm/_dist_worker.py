"""Run under torchrun: every rank builds the same TE graphs, parallelize runs them on torch.distributed
(gloo) with TVM kernels, and each rank checks the whole result against numpy."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.distributed as dist  # noqa: E402
from tvm import te  # noqa: E402

import metadist_tvm  # noqa: E402
from metadist_core.problem.constraints import Pin  # noqa: E402
from metadist_core.ir.placement import Partial, Shard, Sharding  # noqa: E402
from metadist_core.plan.plan import ShardingPlan  # noqa: E402
from metadist_core.problem.build import build_problem  # noqa: E402
from metadist_tvm import topi  # noqa: E402
from metadist_tvm.execute import Parallelized  # noqa: E402
from _tvm_graphs import conv_ref, convnet, draw, mlp, mlp_ref, plain_mlp, plain_mlp_ref  # noqa: E402


RANDOM_PLANS = 8


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs, y = mlp()
    xs = draw(inputs)
    # w1 split by rows: a column-split dense, then an all_gather before the second dense
    f = metadist_tvm.parallelize(inputs, y, (world,), constraints=[Pin("w1", Sharding([Shard(0)]))])
    assert f.engine == "torch", f.engine
    err_mlp = float(np.abs(f(*xs) - mlp_ref(*xs)).max())
    # contraction split: the first dense made Partial(sum), all-reduced before the relu
    f = metadist_tvm.parallelize(inputs, y, (world,), constraints=[Pin("dense_0", Sharding([Partial("sum")]))])
    err_red = float(np.abs(f(*xs) - mlp_ref(*xs)).max())
    kinds = {c.kind for _, c in f.plan.collectives()}
    # random plans that the rules allow, chosen on rank 0 and run by every rank
    mesh = f.mesh
    for k in range(RANDOM_PLANS):
        box = [None]
        if rank == 0:
            problem = build_problem(f.graph, f.result.rulebook, mesh)
            rng = np.random.default_rng(k)
            choice = [int(rng.choice(np.flatnonzero(problem.allowed[i]))) for i in range(len(problem.nodes))]
            box[0] = ShardingPlan.from_choices(problem, choice).to_json()
        dist.broadcast_object_list(box, src=0)
        plan = ShardingPlan.from_json(box[0])
        kinds |= {c.kind for _, c in plan.collectives()}
        run = Parallelized(f.traced, plan, mesh, "torch")
        err_red = max(err_red, float(np.abs(run(*xs) - mlp_ref(*xs)).max()))
    cin, cw = convnet()
    cx = draw(cin, seed=1)
    g = metadist_tvm.parallelize(cin, cw, (world,), constraints=[Pin("x", Sharding([Shard(0)]))])
    err_conv = float(np.abs(g(*cx) - conv_ref(*cx)).max())
    # uneven pieces (5 rows on 2 ranks: 3 and 2), gathered at the end
    ux, uw = te.placeholder((5, 6), name="x"), te.placeholder((3, 6), name="w")
    uy = topi.nn.relu(topi.nn.dense(ux, uw))
    u = metadist_tvm.parallelize([ux, uw], uy, (world,), constraints=[Pin("x", Sharding([Shard(0)]))])
    ua, ub = draw([ux, uw], seed=2)
    err_conv = max(err_conv, float(np.abs(u(ua, ub) - np.maximum(ua @ ub.T, 0)).max()))
    kinds |= {c.kind for _, c in u.plan.collectives()}
    # plain tvm.topi + a constant-extent te.compute matmul, no wrappers: rebuilt per rank's shard shapes
    pin_, py = plain_mlp()
    err_plain = 0.0
    for pins in ([Pin("W1", Sharding([Shard(0)]))], [Pin("X", Sharding([Shard(0)]))]):
        p = metadist_tvm.parallelize(pin_, py, (world,), constraints=pins)
        assert p.engine == "torch" and not p.plan.var_shardings[pins[0].var].is_fully_replicated()
        kinds |= {c.kind for _, c in p.plan.collectives()}
        for seed in (0, 1):
            px = draw(pin_, seed=seed)
            err_plain = max(err_plain, float(np.abs(p(*px) - plain_mlp_ref(*px)).max()))
    colls = sorted(kinds | {c.kind for _, c in g.plan.collectives()})
    ok = err_mlp < 1e-5 and err_red < 1e-5 and err_conv < 1e-4 and err_plain < 1e-5
    line = (
        f"rank {rank}/{world} {'OK' if ok else 'MISMATCH'} mlp {err_mlp:.2e} plans {err_red:.2e} "
        f"conv {err_conv:.2e} plain {err_plain:.2e} collectives {','.join(colls)}"
    )
    print(line, flush=True)
    out_dir = os.environ.get("METADIST_TEST_OUT")
    if out_dir:  # one file per rank: stdout of the ranks interleaves
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as fh:
            fh.write(line + "\n")
    from metadist_torch.runtime.engine import finish_worker

    finish_worker(0 if ok else 1)


if __name__ == "__main__":
    main()
