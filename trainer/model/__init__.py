"""The loaded transformer turned into the one that trains.

- ``prepare.py``: ``prepare_transformer``, the one order of the steps below (shared with the GPU harness);
- ``adapters.py``: what trains: LoRA through peft or every weight (full); save, load, export;
- ``lora_formats.py``: LoRA files in formats other than diffusers' (ComfyUI's);
- ``quantization.py``: frozen weights quantized block by block (optimum-quanto, torchao);
- ``int8_linear.py``: int8 W8A8 linear layers (``quantization.weights: int8_w8a8``);
- ``block_swap.py``: frozen blocks kept in host memory, brought to the GPU just in time;
- ``activation_offload.py``: gradient checkpointing whose kept block inputs live in host memory.

Nothing is imported here: import the module you need (``from trainer.model.adapters import ...``).
"""
