"""Engine parts, data: what is trained on, before any model.

The tokenizer, tasks and their reward functions (one call each, bounded in time), group
advantages, packing samples into `TransportBatch` rows, and the run's outside inputs.
May import the engine's vocabulary (its top-level modules) and `grpod.base`; nothing above.
"""
