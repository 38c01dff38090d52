"""Split a TE graph (dense -> relu -> dense -> softmax, and a small conv net) over a device mesh.

    python examples/tvm/parallel_mlp.py                               # 4 simulated devices, one process
    torchrun --nproc_per_node=2 examples/tvm/parallel_mlp.py          # 2 processes, gloo, TVM kernels per rank

Build the graph with ``metadist_tvm.topi`` (``tvm.topi`` whose operators record
their calls, so that each can be rebuilt at a device's shard shapes) or with
your own builders decorated by ``@metadist_tvm.op``; plain ``tvm.topi`` and
``te.compute`` work too (see ``plain_te.py``), one op per compute.
"""

import os

import numpy as np
from tvm import te

import metadist_tvm
from metadist_core.problem.constraints import Pin
from metadist_core.ir.placement import Shard, Sharding
from metadist_tvm import topi


@metadist_tvm.op
def gelu(x):
    """A user TE compute: a builder that makes it from the tensor it is given."""

    def body(*i):
        v = x(*i)
        return 0.5 * v * (1.0 + te.tanh(0.7978845608 * (v + 0.044715 * v * v * v)))

    return te.compute(x.shape, body, name="gelu")


def main() -> None:
    batch, d_in, hidden, d_out = 16, 32, 64, 16
    x = te.placeholder((batch, d_in), name="x")
    w1 = te.placeholder((hidden, d_in), name="w1")
    w2 = te.placeholder((d_out, hidden), name="w2")
    y = topi.nn.softmax(topi.nn.dense(gelu(topi.nn.dense(x, w1)), w2))

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    # A graph this small is cheapest replicated under the cost model; pinning w1 by rows asks for
    # tensor parallelism (a column-split first dense), and the solver plans the rest around it.
    pins = [Pin("w1", Sharding([Shard(0)]))]
    f = metadist_tvm.parallelize([x, w1, w2], y, None if distributed else (4,), constraints=pins)

    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(s).astype("float32") for s in [(batch, d_in), (hidden, d_in), (d_out, hidden)]]
    out = f(*xs)

    h = xs[0] @ xs[1].T
    h = 0.5 * h * (1 + np.tanh(0.7978845608 * (h + 0.044715 * h**3))) @ xs[2].T
    e = np.exp(h - h.max(-1, keepdims=True))
    ref = e / e.sum(-1, keepdims=True)
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(f.plan)
        print(
            f"{f}: max |parallel - numpy| = {np.abs(out - ref).max():.2e}, "
            f"{metadist_tvm.kernel_cache().builds} kernels compiled"
        )


if __name__ == "__main__":
    main()
