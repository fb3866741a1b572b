"""The GRPO step composed from the engine's parts: the top of `grpod.engine`.

`Engine` (trainer.py: rollout -> advantages -> pack -> accumulate -> apply | flush),
`build_parts`, the assembler (a rollout -> the step's `TransportBatch`), `decide_step`
(step.py), held-out evaluation, preflight checks and samples as text. May import every part
(`rollout`, `train`, `state`, `model`, `data`) and the vocabulary; nothing in the engine
imports it but the package's lazy exports (engine/__init__.py).
"""
