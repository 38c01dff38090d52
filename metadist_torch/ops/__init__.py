"""One aten op at a time for discovery: run on numpy pieces at proxy shapes, its example inputs, its cost, its shape guards."""
