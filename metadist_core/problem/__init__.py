"""The solver's input: ShardingProblem, its terms, how it is built, constraints, pruning, coarsening, presets."""
