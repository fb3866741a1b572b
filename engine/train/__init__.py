"""Engine parts, training: a transport batch -> gradients and the step's report figures.

The trunk layout of a batch, the KV-cache attention mask, the FP32 chunked loss, the
step-accumulated valid-token counter, forward + backward, the optimizer and schedule, and the
per-step statistics. Never imports `engine.rollout` or `engine.state`: below it are
`engine.model`, `engine.data`, the engine's vocabulary and `grpod.base`.
"""
