"""`scripts/gpu-check`'s parts: random models of real shapes, timings, exactness checks and
the projection of a speedup from a GPU's measured costs and a CPU-measured acceptance."""
