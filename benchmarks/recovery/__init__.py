"""The parts of ``benchmarks/recovery_vs_raytrain.py`` (node-loss recovery, side by side).

- ``scenario``: the job, the cluster shape and the settings every side shares;
- ``progress``: the per-step progress lines the baselines' workers append, and the kill
  that watches them;
- one module per system: ``side_ours`` (the elastic runtime), ``side_raytrain`` (Ray Train
  V2, sides ``raytrain_tuned`` and ``raytrain_default``: the same code, two settings),
  ``side_torchft`` (TorchFT standalone), ``side_raytrain_torchft`` (Ray Train V2 with
  ``TorchftConfig``), and ``torchft_loop``, what both TorchFT sides run and how their runs
  are read;
- ``driver``: runs one side of one repetition in a child process on a fresh cluster;
- ``report``: medians and ranges, the printed table, the results file.

Each side runs in its own child process (``python -m benchmarks.recovery_vs_raytrain
--_child CFG``) on a private ``TMPDIR``.
"""
