"""From raw text to the training stream: ``elastic prepare`` and the per-host data feeders.

See docs/data.md.
"""
