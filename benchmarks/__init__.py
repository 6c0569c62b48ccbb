"""The benchmarks: scripts that measure the runtime against a baseline run side by side and
print ratios (``benchmarks/results/`` holds what they measured, with date and host).

Each benchmark runs both ways, from anywhere, once the project is installed (``make install``
puts this package on the path):

    python -m benchmarks.overhead --help
    python benchmarks/overhead.py --help

``python -m benchmarks list`` (``make bench-list``) lists them with what each measures and
its results file; ``python -m benchmarks run`` (``make bench``) runs them all at their quick
settings. ``benchmarks/harness/`` is what they share (clusters, node kills, statistics,
results files, child processes). Benchmarks import nothing from ``tests/``.
"""
