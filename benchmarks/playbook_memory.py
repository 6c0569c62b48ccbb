"""The memory model against the Ultra-Scale Playbook's published single-node measurements.

The playbook (Hugging Face, "The Ultra-Scale Playbook: Training LLMs on GPU Clusters",
https://huggingface.co/spaces/nanotron/ultrascale-playbook, section "Benchmarking thousands
of configurations") publishes the peak GPU memory of every configuration it ran, in its
interactive benchmark figure (``assets/data/benchmarks/benchmarks_interactive.html`` of the
space: the 8B panel, 1 node of 8 H100 80GB). All runs: sequence length 4096, global batch 256
samples (1M tokens), nanotron. ``PUBLISHED`` below copies the 13 configurations with a
measurement (dp, tp, pp, ZeRO, micro-batch, gradient accumulation, GB); the others are
marked failed there.

Side by side, per configuration: the published peak (the baseline) and this project's
estimate for Llama 3.1 8B (``model.size: llama3.1-8b``, seq 4096) trained by this engine in
bf16 (``estimate_memory`` as the sweep calls it), their ratio, and where the estimate puts
the bytes. Pure arithmetic: nothing is measured here, nothing needs a GPU.

They are different engines, so the ratio is an account of what each keeps, not an error
(docs/sweep.md, "Against published runs"). nanotron (its benchmark configs,
``examples/config_tiny_llama_bench.yaml``): bf16 parameters with fp32 master weights in the
optimizer and fp32 gradient accumulation buffers, TP with sequence parallelism
(``tp_mode: REDUCE_SCATTER``), 1F1B with buffers for the micro-batches in flight. This
engine: fp32 parameters, gradients and AdamW moments with autocast's bf16 weight copies and
an fp32 residual stream (ZeRO 0), or FSDP2's bf16 policy (ZeRO >= 1); TP without sequence
parallelism; torch's ``PipelineStage``, which keeps a receive buffer for every micro-batch of
the step.

Usage::

    .venv/bin/python -m benchmarks.playbook_memory [--json OUT]
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.harness.results import utc_stamp, write_json

SOURCE = (
    "The Ultra-Scale Playbook (https://huggingface.co/spaces/nanotron/ultrascale-playbook), interactive "
    "benchmark figure assets/data/benchmarks/benchmarks_interactive.html, 8B panel, 1 node of 8 H100 80GB; "
    "seq 4096, global batch 256"
)
# (dp, tp, pp, zero, micro_batch, grad_accum, published GB)
PUBLISHED = (
    (2, 1, 4, 1, 1, 128, 63.1),
    (4, 2, 1, 1, 1, 64, 65.2),
    (2, 2, 2, 1, 2, 64, 62.6),
    (1, 1, 8, 0, 1, 256, 62.5),
    (2, 2, 2, 0, 1, 128, 63.6),
    (2, 2, 2, 1, 1, 128, 53.7),
    (1, 2, 4, 0, 1, 256, 40.9),
    (2, 4, 1, 0, 1, 128, 51.4),
    (2, 4, 1, 1, 1, 128, 36.1),
    (1, 8, 1, 0, 8, 32, 60.1),
    (1, 4, 2, 0, 1, 256, 30.8),
    (1, 8, 1, 0, 1, 256, 24.4),
    (4, 1, 2, 1, 1, 64, 71.5),
)
GB = 1e9


def compare(size: str = "llama3.1-8b") -> list[dict]:
    from elastic.models.config import LlamaConfig
    from elastic.parallel.memory_model import estimate_memory

    cfg = LlamaConfig(size=size, seq_len=4096)
    rows = []
    for dp, tp, pp, zero, mb, accum, published in PUBLISHED:
        est = estimate_memory(
            cfg, tp=tp, pp=pp, dp=dp, zero=zero, micro_batch=mb, num_microbatches=accum, compute_dtype_bytes=2
        )
        rows.append(
            {
                "config": f"dp{dp} tp{tp} pp{pp} z{zero} mbs{mb} ga{accum}",
                "published_gb": published,
                "predicted_gb": round(est.total / GB, 1),
                "predicted_over_published": round(est.total / GB / published, 2),
                "stage": est.stage,
                "state_gb": round((est.params + est.grads + est.optimizer + est.buffers) / GB, 1),
                "activations_gb": round(est.activations / GB, 1),
                "pipeline_gb": round(est.pipeline / GB, 1),
                "logits_gb": round(est.logits / GB, 1),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3.1-8b", choices=["llama3.1-8b", "llama3-8b"], help="the named size")
    ap.add_argument("--json", help="write the table here")
    args = ap.parse_args(argv)
    rows = compare(args.model)
    print(f"Source: {SOURCE}")
    print(f"This project: {args.model}, bf16 (autocast with ZeRO 0, FSDP2 bf16 with ZeRO >= 1), worst stage")
    head = (
        f"{'configuration':<30}{'published':>10}{'ours':>8}{'ours/pub':>9}{'state':>8}{'acts':>8}{'pipe':>8}{'loss':>7}"
    )
    print(head + "   (GB)")
    for r in rows:
        print(
            f"{r['config']:<30}{r['published_gb']:>10.1f}{r['predicted_gb']:>8.1f}{r['predicted_over_published']:>9.2f}"
            f"{r['state_gb']:>8.1f}{r['activations_gb']:>8.1f}{r['pipeline_gb']:>8.1f}{r['logits_gb']:>7.1f}"
        )
    ratios = [r["predicted_over_published"] for r in rows]
    print(f"ours/published: median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}")
    if args.json:
        write_json(args.json, {"date_utc": utc_stamp(), "source": SOURCE, "rows": rows})


if __name__ == "__main__":
    main()
