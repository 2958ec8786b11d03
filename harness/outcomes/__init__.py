"""Records of what serving produced: a request's result or failure and its evidence.

The leaf between serving and judging: `harness.serve` fills these in, `harness.judge` reads
them; nothing here opens a socket or starts a process.
"""
