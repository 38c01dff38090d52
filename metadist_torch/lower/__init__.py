"""A plan lowered to per-rank torch.fx programs: collectives, buckets, async schedule, in-place updates, offload, compression, and the runnable whole, micro-batched and pipelined steps."""
