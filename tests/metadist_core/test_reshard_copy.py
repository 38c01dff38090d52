"""A gather or scatter of a dim behind another of more than one element copies its whole buffer (XLA's CPU
runtime transposes it, the torch lowering concatenates or packs the pieces): priced where the mesh's links
measured a local copy (``local_copy``), once per byte of the collective's buffer; nothing otherwise."""

from __future__ import annotations

import pytest

from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Replicate, Shard, Partial, Sharding
from metadist_core.cost.reshard import reshard

ALPHA, BETA, COPY = 1e-5, 1e-9, 4e-10


def _mesh(copy: bool) -> Mesh:
    links = [{"local_copy": (0.0, COPY)}] if copy else None
    return Mesh((2,), alpha=[ALPHA], beta=[BETA], links=links)


@pytest.mark.parametrize("dim,inner", [(0, False), (1, True)])
def test_a_gather_of_an_inner_dim_pays_for_a_copy_of_what_it_gathers(dim, inner):
    shape = (4, 8)
    src, dst = Sharding((Shard(dim),)), Sharding((Replicate(),))
    plain = reshard(src, dst, shape, "float32", _mesh(False))
    priced = reshard(src, dst, shape, "float32", _mesh(True))
    assert [c.kind for c in plain] == [c.kind for c in priced] == ["all_gather"]
    gathered = 4 * 8 * 4
    assert priced[0].nbytes == gathered
    assert priced[0].cost == pytest.approx(plain[0].cost + (COPY * gathered if inner else 0.0))


@pytest.mark.parametrize("dim,inner", [(0, False), (1, True)])
def test_a_scatter_of_an_inner_dim_pays_for_a_copy_of_its_input(dim, inner):
    shape = (4, 8)
    src, dst = Sharding((Partial("sum"),)), Sharding((Shard(dim),))
    plain = reshard(src, dst, shape, "float32", _mesh(False))
    priced = reshard(src, dst, shape, "float32", _mesh(True))
    assert [c.kind for c in priced] == ["reduce_scatter"]
    assert priced[0].cost == pytest.approx(plain[0].cost + (COPY * 4 * 8 * 4 if inner else 0.0))


def test_a_leading_dim_of_one_element_keeps_the_pieces_contiguous():
    src, dst = Sharding((Shard(1),)), Sharding((Replicate(),))
    plain = reshard(src, dst, (1, 8), "float32", _mesh(False))
    priced = reshard(src, dst, (1, 8), "float32", _mesh(True))
    assert priced[0].cost == pytest.approx(plain[0].cost)
