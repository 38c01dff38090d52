"""MetaDist core: placements, MetaIR, ShardCombine, rules, cost model, problems, plans and the one driver.
Pure Python and numpy: no framework import. Frontends and users import the names below from here; the
folders follow the flow trace -> discover -> solve -> share -> lower (see CONTRIBUTING.md)."""

from metadist_core.config import Settings, load_settings
from metadist_core.discovery.rules import OpRules, ShardingRule
from metadist_core.discovery.shardcombine import OpSpec, Unrunnable, discover_rules
from metadist_core.driver.compile import compile_step
from metadist_core.driver.step import CompiledStep
from metadist_core.driver.frontend import Frontend, NotSupported, Traced, Watch
from metadist_core.driver.planner import plan_graph
from metadist_core.driver.sideeffects import SideEffectError
from metadist_core.hookspecs import hookimpl
from metadist_core.ir.ir import MetaIR, MetaOp, MetaVar
from metadist_core.ir.mesh import Mesh
from metadist_core.ir.placement import Partial, Placement, Replicate, Shard, Sharding
from metadist_core.plan.plan import ShardingPlan
from metadist_core.plan.stage import Stage
from metadist_core.plugins import PluginManager
from metadist_core.problem.problem import ShardingProblem
from metadist_core.version import __version__

__all__ = [
    "SideEffectError",
    "CompiledStep",
    "Frontend",
    "Mesh",
    "MetaIR",
    "MetaOp",
    "MetaVar",
    "NotSupported",
    "OpRules",
    "OpSpec",
    "Partial",
    "Placement",
    "PluginManager",
    "Replicate",
    "Settings",
    "Shard",
    "Sharding",
    "ShardingPlan",
    "ShardingProblem",
    "ShardingRule",
    "Stage",
    "Traced",
    "Unrunnable",
    "Watch",
    "__version__",
    "compile_step",
    "discover_rules",
    "hookimpl",
    "load_settings",
    "plan_graph",
]
