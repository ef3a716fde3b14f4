"""The speculative decoding loop: drafters propose, the target verifies, the answer streams.

`speculative.SpeculativeEngine.generate()` is the loop; `drafters` the proposers,
`acceptance` and `sampling` the rules that keep the target's output, `adaptive` and
`policy` how many tokens to draft, `selfcheck` the proof at load that a verify computes what
a plain step does. The models and their caches are runners (`kernels.runner.Runner`), each
device's beside its kernels. Knows nothing of files.
"""
