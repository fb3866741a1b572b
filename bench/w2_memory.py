"""W2 `long-prompt`: peak memory of the training pass with `lmhead_chunks` 1, 4 and 16.

    .venv/bin/python bench/w2_memory.py [--long-fraction 0.25] [--stress-vocab 32000]

tracemalloc does not see torch's allocations and CPU torch keeps no allocator statistics,
so the peak is the process's: each setting runs in a fresh process, which resets the kernel's
high-water mark (`/proc/self/clear_refs` 5) right before `accumulate` and reads `VmHWM`
after it; the training-pass peak is `VmHWM` minus the RSS just before. The same is done
for the FP32 head alone at a 32k vocabulary (`token_logprobs` forward + backward), where
the full logits are large enough to matter; W2's own 44-token vocabulary makes its logits
tiny next to the trunk's activations.
"""

from __future__ import annotations

import os

from common import (
    emit,
    engine_config,
    in_child,
    numeric_options,
    reset_peak,
    set_threads,
    status_kib,
)

CHUNKS = (1, 4, 16)
MIB = 1024 * 1024


def _w2_worker(conn, chunks: int, long_fraction: float, steps: int) -> None:
    set_threads()
    import torch

    from grpod.engine import Engine

    cfg = engine_config(
        "kv-retrieval",
        seq_len=256,
        sequence_chunks=4,
        lmhead_chunks=chunks,
        long_prompt_batch_fraction=long_fraction,
    )
    engine = Engine(cfg)
    vocab = engine.model.get_output_embeddings().weight.shape[0]
    params_mib = sum(p.numel() * p.element_size() for p in engine.model.parameters()) / MIB
    peaks, logits = [], []
    for _ in range(steps):
        batch = engine.rollout()
        before = reset_peak()
        engine.accumulate(batch)
        peaks.append(status_kib("VmHWM") / 1024 - before)
        engine.apply()
        rows_per_micro = batch.input_ids.shape[1]
        logits.append(
            {
                "full_sequence_mib": rows_per_micro * batch.seq_len * vocab * 4 / MIB,
                "trainable_tokens_mib": int(batch.loss_mask.sum(dim=(1, 2)).max())
                * vocab
                * 4
                / MIB,
            }
        )
    torch.set_num_threads(1)
    conn.send(
        {
            "lmhead_chunks": chunks,
            "train_pass_peak_mib": round(max(peaks), 1),
            "params_mib": round(params_mib, 2),
            "full_fp32_logits_per_micro_mib": round(max(x["full_sequence_mib"] for x in logits), 3),
            "trainable_logits_per_micro_mib": round(
                max(x["trainable_tokens_mib"] for x in logits), 4
            ),
        }
    )


def _head_worker(conn, chunks: int, vocab: int, tokens: int, hidden: int) -> None:
    set_threads()
    import torch

    from grpod.engine.model.head import token_logprobs

    gen = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=gen, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=gen, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    before = reset_peak()
    token_logprobs(h, w, targets, chunks=chunks).sum().backward()
    peak = status_kib("VmHWM") / 1024 - before
    conn.send({"lmhead_chunks": chunks, "peak_mib": round(peak, 1)})


def main() -> None:
    args = numeric_options(
        __doc__, long_fraction=0.25, steps=4, stress_vocab=32000, stress_tokens=2048
    )
    # children: large buffers straight from mmap, so a freed tensor leaves RSS at once and the
    # high-water mark tracks live memory, not glibc's heap reuse
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    w2 = [in_child(_w2_worker, c, args.long_fraction, args.steps) for c in CHUNKS]
    hidden = 128
    stress = [
        in_child(_head_worker, c, args.stress_vocab, args.stress_tokens, hidden) for c in CHUNKS
    ]
    logits_mib = args.stress_tokens * args.stress_vocab * 4 / MIB
    for row in stress:
        row["peak_over_full_logits"] = round(row["peak_mib"] / logits_mib, 3)
    emit(
        {
            "workload": "W2",
            "w2": w2,
            "w2_peak_ratio_16_over_1": round(
                w2[2]["train_pass_peak_mib"] / max(w2[0]["train_pass_peak_mib"], 1e-9), 3
            ),
            "head_stress": {
                "vocab": args.stress_vocab,
                "tokens": args.stress_tokens,
                "hidden": hidden,
                "full_fp32_logits_mib": round(logits_mib, 1),
                "by_chunks": stress,
            },
        }
    )


if __name__ == "__main__":
    main()
