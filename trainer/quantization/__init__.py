"""Frozen weights stored in fewer bits: the floor below the families (which quantize their text encoders
with it) and the trainable model (which quantizes the transformer's blocks).

- ``frozen_weights.py``: frozen weights quantized block by block (optimum-quanto, torchao), ``auto`` resolved
  per device, the run's choice read from its config (``quantization_choice``, ``text_encoder_choice``);
- ``w8a8_linear.py``: 8-bit W8A8 linear layers, int8 and fp8 (``quantization.weights: int8_w8a8``,
  ``float8_w8a8``, ``auto``).

The format names and ``QuantizationChoice`` are torch-free facts: ``trainer/facts/quantization_formats.py``.
Old import paths (``trainer.model.quantization``, ``trainer.model.quantized_linear``) still work.
Nothing is imported here: import the module you need.
"""
