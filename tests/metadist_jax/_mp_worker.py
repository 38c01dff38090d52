"""One process of the two-process test: the MLP step under jax.distributed on 4 local CPU devices.

python _mp_worker.py PROCESS_ID NUM_PROCESSES PORT OUT.npz CACHE_DIR STEPS
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("METADIST_PROGRESS", "0")

import numpy as np  # noqa: E402

import jax  # noqa: E402

pid, nproc, port, out, cache_dir, steps = sys.argv[1:7]
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=int(nproc), process_id=int(pid))

import optax  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "jax"))
import mlp  # noqa: E402

from metadist_jax import metadist_compile  # noqa: E402
from metadist_jax.engine import plan_digest, to_host  # noqa: E402

assert jax.process_count() == int(nproc) and jax.local_device_count() == 4, (jax.process_count(), jax.local_devices())
opt = optax.adam(1e-3)
params = mlp.init_params(jax.random.key(0), mlp.TEST_SIZES)
opt_state = opt.init(params)
step = metadist_compile(mlp.make_step(opt), mesh=(jax.device_count(),), cache_dir=cache_dir)
losses = []
for i in range(int(steps)):
    loss, params, opt_state = step(params, opt_state, mlp.make_batch(i, **mlp.TEST_BATCH))
    losses.append(float(to_host(loss)))
leaves = {jax.tree_util.keystr(p): to_host(v) for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
specs = {
    k: str(v.sharding.spec)
    for k, v in [(jax.tree_util.keystr(p), v) for p, v in jax.tree_util.tree_flatten_with_path(params)[0]]
}
np.savez(out, losses=np.asarray(losses), digest=plan_digest(step.plan), specs=repr(specs), **leaves)
jax.distributed.shutdown()
