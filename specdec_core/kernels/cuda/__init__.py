"""CUDA compute: the fixed-shape step (`static_step.StaticRunner`: a static KV cache, a fixed
row count, CUDA graphs), attention by position with its Triton kernel, and the nf4 row
kernel that reads bitsandbytes' stored 4-bit weights. Imported only where a model is on CUDA
or a test runs the step eagerly; Triton is imported only where a kernel launches.
"""
