"""Engine parts, model: the policy and what runs it, shared by rollout and training.

Loading (`policy`), LoRA adapters, the fused static-cache decoder and its bounded-KV form,
the training trunk, the FP32 head (`head`: token logprobs, a sequence scored through the
trunk), one flat storage of the weights, and data parallelism (`parallel`). May import
`engine.data`, the engine's vocabulary and `grpod.base`.
"""
