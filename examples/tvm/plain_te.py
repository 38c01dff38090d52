"""Split a graph written with plain ``tvm.topi`` and ``te.compute`` (no MetaDist wrappers) over a mesh.

    python examples/tvm/plain_te.py                              # 4 simulated devices, one process
    torchrun --nproc_per_node=2 examples/tvm/plain_te.py         # 2 processes, gloo, TVM kernels per rank

Each ComputeOp's body is rebuilt at every device's shard shapes; the matmul
below has constant extents and still splits by rows, columns or contraction.
"""

import os

import numpy as np
import tvm.topi as topi
from tvm import te

import metadist_tvm
from metadist_core.problem.constraints import Pin
from metadist_core.ir.placement import Shard, Sharding


def main() -> None:
    batch, d_in, hidden, d_out = 16, 32, 64, 16
    x = te.placeholder((batch, d_in), name="X")
    w1 = te.placeholder((hidden, d_in), name="W1")
    b1 = te.placeholder((hidden,), name="b1")
    w2 = te.placeholder((hidden, d_out), name="W2")
    h = topi.nn.relu(topi.add(topi.nn.dense(x, w1), b1))
    k = te.reduce_axis((0, hidden), name="k")
    m = te.compute((batch, d_out), lambda i, j: te.sum(h[i, k] * w2[k, j], axis=k), name="mm")
    y = topi.nn.softmax(m)

    print(metadist_tvm.rules_for(m))  # the rules of the plain matmul: rows, columns, contraction
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    pins = [Pin("W1", Sharding([Shard(0)]))]  # tensor parallel first layer; the solver plans the rest
    f = metadist_tvm.parallelize([x, w1, b1, w2], y, None if distributed else (4,), constraints=pins)

    rng = np.random.default_rng(0)
    xs = [rng.standard_normal([int(s) for s in p.shape]).astype("float32") for p in (x, w1, b1, w2)]
    r = np.maximum(xs[0] @ xs[1].T + xs[2], 0) @ xs[3]
    e = np.exp(r - r.max(-1, keepdims=True))
    err = np.abs(f(*xs) - e / e.sum(-1, keepdims=True)).max()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f.plan)
        print(f"{f}: max |parallel - numpy| = {err:.2e}")


if __name__ == "__main__":
    main()
