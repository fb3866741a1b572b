"""Engine parts, state: what survives a restart.

The data cursor, the engine's state as checkpoints take it (`engine_state`), checkpoints of
`Stateful` objects on one process (`checkpoint`) and under torchrun (`distcp`), and export
of a checkpoint's policy as a Hugging Face directory. Never imports `engine.rollout` or
`engine.train`: below it are `engine.model`, `engine.data`, the vocabulary and `grpod.base`.
"""
