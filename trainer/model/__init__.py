"""The loaded transformer turned into the one that trains.

- ``prepare.py``: ``prepare_transformer``, the one order of the steps below (``trainer/assembly.py`` calls it
  for the engine, the judge and the GPU harness);
- ``adapters.py``: what trains: LoRA through peft or every weight (full); save, load, export;
- ``lora_formats.py``: LoRA files in formats other than diffusers' (ComfyUI's);
- ``quantization.py``, ``quantized_linear.py``, ``int8_linear.py``: old import paths of
  ``trainer/quantization/`` (frozen weights in fewer bits sit a floor below the families, which use them too);
- ``block_swap.py``: frozen blocks kept in host memory, brought to the GPU just in time;
- ``activation_offload.py``: gradient checkpointing whose kept block inputs live in host memory.

Nothing is imported here: import the module you need (``from trainer.model.adapters import ...``).
"""
