"""MetaDist core: placements, MetaIR, ShardCombine, rules, cost model, problems and plans. No framework imports."""
__version__ = "0.1.0"
