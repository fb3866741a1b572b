"""The drills' engine workloads (shared/bench/WORKLOADS.md), cut down for CPU: `[engine]`
settings over the defaults. The tests and the benches derive theirs from these."""

from __future__ import annotations

W1_SMALL = dict(task="arith", prompts_per_step=4, group_size=4)
# W1c with one completion token (its reward reads only the first token), which is cheaper;
# 16 groups, so that a clean step almost never has a zero-std group fraction above 0.9
W1C = dict(task="copy", prompts_per_step=16, group_size=8, max_new_tokens=1, seq_len=32)
# W2's geometry: kv-retrieval prompts in 256-token rows of 4 sequence chunks, 4 head chunks;
# the drill, the tests and the benches add their own batch sizes
W2_GEOMETRY = dict(task="kv-retrieval", seq_len=256, sequence_chunks=4, lmhead_chunks=4)
W2_SMALL = dict(  # the W2 accounting workload, cut down for CPU
    W2_GEOMETRY,
    prompts_per_step=2,
    group_size=4,
    micro_batch_rows=2,
    max_new_tokens=2,
    long_prompt_batch_fraction=0.25,
)
