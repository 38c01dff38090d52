"""How an op may be split: op patterns, canonical names, ShardCombine, verification, rules and the rule book."""
