"""This device and its links measured: op slowdowns, rates, collective timings, a step's peak memory."""
