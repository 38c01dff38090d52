"""Discovery in forked worker processes: the same rules as in one process, and an op that kills its
process runs replicated (one warning naming it) while the rest of the step is still discovered."""

import dataclasses
import logging
import os
import signal
import sys

import pytest

from metadist_core.discovery.discover import discover, worker_count
from metadist_core.hookspecs import hookimpl
from metadist_core.plugins import PluginManager
from metadist_core.reference.plugin import ReferenceFrontend, transformer_block
from metadist_core.discovery.rules import RuleBook

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="forked discovery workers are a Linux path")

CRASHES = "np.gelu"


class _Forking(ReferenceFrontend):
    name = "forking"
    traits = dataclasses.replace(ReferenceFrontend.traits, can_fork_discovery=lambda: True)


class _Crashing(_Forking):
    name = "crashing"

    def op_spec(self, op, graph):
        spec = super().op_spec(op, graph)
        if op.key != CRASHES:
            return spec

        def trap(*args):  # what a kernel that divides by an empty dim does to its process
            os.kill(os.getpid(), signal.SIGFPE)

        return dataclasses.replace(spec, fn=trap)


class _Plugin:
    def __init__(self, adapter):
        self.adapter = adapter

    @hookimpl
    def metadist_frontend(self):
        return self.adapter


def _pm(adapter) -> PluginManager:
    pm = PluginManager(load_entry_points=False)
    pm.register(_Plugin(adapter), "frontend", adapter.name)
    return pm


def _rules(book: RuleBook) -> dict:
    return {k: (e.status, sorted(map(str, e.rules))) for k, e in book.entries.items()}


def test_workers_find_the_rules_one_process_finds():
    graph = transformer_block()
    one = discover(graph, _pm(_Forking()), RuleBook(), axis_sizes=(2, 4), progress=False, workers=1)
    two = discover(graph, _pm(_Forking()), RuleBook(), axis_sizes=(2, 4), progress=False, workers=2)
    assert len(one.entries) > 12 and two.discovered == one.discovered
    assert _rules(two) == _rules(one)


def test_an_op_that_kills_its_process_runs_replicated_and_discovery_goes_on(caplog):
    graph = transformer_block()
    serial = discover(graph, _pm(_Forking()), RuleBook(), axis_sizes=(2,), progress=False, workers=1)
    with caplog.at_level(logging.WARNING, logger="metadist"):
        book = discover(graph, _pm(_Crashing()), RuleBook(), axis_sizes=(2,), progress=False, workers=2)
    gelu = [k for k in book.entries if k.startswith(CRASHES)]
    assert gelu and all(book.entries[k].status == "replicated" for k in gelu)
    assert "SIGFPE" in book.entries[gelu[0]].note
    warned = [r.getMessage() for r in caplog.records if CRASHES in r.getMessage()]
    assert len(warned) == 1 and "killed the discovery process" in warned[0], warned
    others = {k: v for k, v in _rules(book).items() if not k.startswith(CRASHES)}
    assert others == {k: v for k, v in _rules(serial).items() if not k.startswith(CRASHES)}
    assert any(e.status == "ok" and len(e.rules) > 1 for e in book.entries.values())


def test_worker_count_falls_back_to_one_process():
    fork, plain = _Forking(), ReferenceFrontend()
    assert worker_count(0, 100, [plain]) == 1  # a frontend that cannot fork
    assert worker_count(0, 3, [fork]) == 1  # too few patterns to pay for a fork
    assert worker_count(1, 100, [fork]) == 1  # asked for none
    assert worker_count(3, 2, [fork]) == 2  # never more than the patterns
    assert worker_count(0, 100, [fork], all_owned=False) == 1
    assert 1 <= worker_count(0, 100, [fork]) <= 8
