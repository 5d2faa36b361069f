"""The built-in pack backends; importing this package registers them (`pallas_kernels.registry`).

host (numpy), xla (any JAX platform), tpu / tpu-interpret (Pallas Mosaic TPU), gpu-triton /
gpu-mosaic and their -interpret forms (the kernels of `pallas_kernels.gather`).
"""

from pallas_kernels.backends import gpu, host, tpu, xla  # noqa: F401
