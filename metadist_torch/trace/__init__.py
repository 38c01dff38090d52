"""A whole training step traced into one functional graph and its MetaIR: its state, run-time inputs and guards."""
