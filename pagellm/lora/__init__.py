"""Multi-LoRA serving: PEFT adapters applied on top of the base model, many in one step.

The path of an adapter: the server's registry (`model` name -> `LoRARequest`) ->
the engine core's `LoRAModelManager` (loads and checks the PEFT files, keeps an LRU of
loaded adapters in host memory, gives each step's adapters a slot) -> the scheduler (counts
distinct adapters by an integer, at most `--max-loras` per step) -> the model runner
(a token -> slot mapping per step) -> `LoRALinear` (base matmul once, then each adapter's
shrink and expand over its tokens only).
"""
