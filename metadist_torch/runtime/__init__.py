"""The process group and DeviceMesh, lost ranks named, the plan shared from rank 0, what collectives moved."""
