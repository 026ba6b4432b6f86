"""Compiling jaxgen's programs for hardware this machine does not have (compile-only devices).

    gpu.py   the decode loop compiled for an NVIDIA GPU described by a target config (the CUDA plugin,
             no GPU needed), and the kernels one step of it launches, counted from XLA:GPU's HLO

This package sits above the model and inference: it builds their programs and reads what a real
compiler made of them; nothing below imports it.
"""
