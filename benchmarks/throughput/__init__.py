"""The parts of ``benchmarks/overhead.py`` (steady-state throughput against torchrun DDP):
``sides`` runs one repetition of each side in its own process tree and reads its step times
and CPU; ``report`` checks that both sides trained the same losses, prints the table and
ratios, and writes the JSON.
"""
