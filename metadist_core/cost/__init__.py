"""What a plan costs: the cost model, the reshard search, phases, buckets, gathers, fusion, compression, profiles, local op times."""
