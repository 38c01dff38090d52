"""The program as data: placements and meshes, MetaIR (values, ops, roles, backward slices), aliasing, recorded graphs."""
