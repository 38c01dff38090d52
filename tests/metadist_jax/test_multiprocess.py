"""Two processes under jax.distributed on CPU (gloo), 4 devices each, run the MLP step on mesh (8,)
and agree with one process on 8 devices: same plan, same losses, same parameters."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

from metadist_jax import metadist_compile  # noqa: E402
from metadist_jax.engine import plan_digest  # noqa: E402

from _jax_models import load_example  # noqa: E402

WORKER = pathlib.Path(__file__).with_name("_mp_worker.py")
STEPS = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_agree_with_one(devices8, rule_cache, tmp_path):
    mlp = load_example("mlp")
    opt = optax.adam(1e-3)
    params = mlp.init_params(jax.random.key(0), mlp.TEST_SIZES)
    opt_state = opt.init(params)
    step = metadist_compile(mlp.make_step(opt), mesh=(8,), cache_dir=rule_cache)
    losses = []
    for i in range(STEPS):
        loss, params, opt_state = step(params, opt_state, mlp.make_batch(i, **mlp.TEST_BATCH))
        losses.append(float(loss))

    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(pathlib.Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    outs = [tmp_path / f"p{i}.npz" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), "2", str(port), str(outs[i]), rule_cache, str(STEPS)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("the two-process run did not finish in 150 s")
        logs.append(out)
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} failed:\n{logs[i][-3000:]}"

    results = [np.load(o) for o in outs]
    for r in results:
        assert str(r["digest"]) == plan_digest(step.plan), "a process reached another plan than one process did"
        np.testing.assert_allclose(r["losses"], np.asarray(losses), rtol=1e-5)
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
            np.testing.assert_allclose(r[jax.tree_util.keystr(path)], np.asarray(leaf), rtol=1e-5, atol=1e-7)
