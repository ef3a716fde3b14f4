"""Models on disk and in memory: references, the catalog, fetching, GGUF conversion,
the disk cache, loading a target and pairing it with a drafter (`pair`).
"""
