"""The shared training engine: one loop for every model family."""

import logging

# torchao (an optional quantization backend) warns at import about kernels built for other Pythons
# and GPUs, and diffusers and torch echo it; none of it concerns a run that doesn't use those kernels.
for _name in ("torchao", "diffusers.quantizers.torchao.torchao_quantizer", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)
