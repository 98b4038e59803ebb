"""The loaded transformer turned into the one that trains.

- ``prepare.py``: ``prepare_transformer``, the one order of the steps below (``trainer/assembly.py`` calls it
  for the engine, the judge and the GPU harness);
- ``adapters.py``: what trains: LoRA through peft or every weight (full); save, load, export;
- ``lora_formats.py``: LoRA files in formats other than diffusers' (ComfyUI's);
- ``quantization.py``: frozen weights quantized block by block (optimum-quanto, torchao);
- ``quantized_linear.py``: 8-bit W8A8 linear layers, int8 and fp8 (``quantization.weights: int8_w8a8``,
  ``float8_w8a8``, ``auto``; ``int8_linear.py`` is its old import path);
- ``block_swap.py``: frozen blocks kept in host memory, brought to the GPU just in time;
- ``activation_offload.py``: gradient checkpointing whose kept block inputs live in host memory.

Nothing is imported here: import the module you need (``from trainer.model.adapters import ...``).
"""
