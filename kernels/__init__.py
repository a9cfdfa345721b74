"""Compute kernels of flide_sdk, installed as `flide_sdk.kernels`.

One module per kernel. Each module holds the pure-torch reference (the definition, used on CPU and in
tests) and, once written, the Triton kernel with its autograd-free wrapper, proven against that
reference. Kernels read only device tensors planned on the host (`flide_sdk.layout`), so their launch
shapes depend on the stream capacity alone.
"""
