"""The solver's output: ShardingPlan, pipeline stages, the interpreter, simulation, explanation, overlap, memory prediction."""
