"""Layout-independent checkpoints through torch.distributed.checkpoint, committed whole or not at all."""
