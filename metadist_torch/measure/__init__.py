"""This device and its links measured: op slowdowns, matmul and memory rates, collective timings, a step's peak memory."""
