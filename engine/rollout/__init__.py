"""Engine parts, rollout: completions from the policy, and the weight sync before them.

The three sampling backends (the torch sampler, colocated vLLM, a vLLM server) behind one
`Sampler` protocol (`rollout/sampler.py`), stop strings, vLLM's limits, `Sampling` (the
backend chosen by config, the sync check) and rollouts ahead of training. Never imports
`engine.train` or `engine.state`: below it are `engine.model`, `engine.data`, the engine's
vocabulary and `grpod.base`.
"""
