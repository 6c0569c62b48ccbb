"""Model parallelism: one file per parallelism, one ``parallelize`` applying them in order.

* ``dims.py``        ``ParallelDims``: degrees, validation, the ("dp", "pp", "tp") mesh
* ``tp.py``          tensor parallelism (DTensor plans, vocab/loss parallel)
* ``ac.py``          activation checkpointing per block
* ``fsdp.py``        ZeRO-1/2/3 with FSDP2 ``fully_shard``
* ``ddp.py``         replicated data parallelism (zero 0)
* ``pp.py``          pipeline stages and schedules (1F1B, GPipe)
* ``clip.py``        global gradient-norm clipping across shards and stages
* ``parallelize.py`` TP -> recompute -> FSDP/DDP

``TrainEngine``, what a worker trains with, sits above this package and ``elastic/models/``
(``elastic/engine.py``); the types both share sit below them (``elastic/protocols/``).

Kept import-free: ``elastic.parallel.config`` is read by the CLI's input checks, which
must not pay for importing torch.distributed.
"""
