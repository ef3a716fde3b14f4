"""CPU compute: the C kernels beside their Python wrappers, the native loader and its
trust checks, the CPU's features, the thread governor, huge pages, the int8/int4
linears that replace torch's where they keep a verify bitwise equal to a plain step, and
the CPU's runner (`runner.CachedModel`).
"""
