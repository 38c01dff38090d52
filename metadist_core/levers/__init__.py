"""What rewrites the graph, the problem or the plan: recomputation, offload, micro-batches, pipeline stages."""
