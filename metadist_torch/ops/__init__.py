"""One aten op for discovery: run on numpy pieces at proxy shapes, its example inputs, cost, shape guards."""
