"""The process group and DeviceMesh, a lost rank found and named, the plan shared from rank 0, what collectives moved."""
