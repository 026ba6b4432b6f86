"""Compiling jaxgen's programs for hardware this machine does not have (compile-only devices).

    catalog.py    named TPU slices and GPU nodes (`TARGETS`) with each chip's published peaks
    devices.py    their compile-only devices and meshes (libtpu, the CUDA plugin), tracing as their backend
    roofline.py   a compiled program's counts (flops, HBM bytes, collective bytes, kernels) -> an estimate
    hlo.py        reading optimised HLO text: computations, launches, flops and bytes counted from kernels
    gpu.py        the decode loop compiled for an NVIDIA GPU, and the kernels one step of it launches
    specs/        the GPU target descriptions (GpuTargetConfigProto texts, their source in README.md)

`python -m jaxgen.plan --target tpu-v5p-8 ...` plans memory on the target's own compiler and adds the
roofline; `bench/aot.py` tabulates both for real model shapes. This package sits above the model and
inference: it builds their programs and reads what a real compiler made of them; nothing below imports it.
"""
