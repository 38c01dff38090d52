"""A plan lowered to per-rank fx programs, and the whole, micro-batched and pipelined steps that run them."""
