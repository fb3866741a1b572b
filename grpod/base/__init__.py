"""The ground layer: mechanisms every grpod package shares, importing no grpod package.

Atomic writes (`fileio`), JSON for non-finite numbers (`jsonsafe`), one-line exception text
(`oneline`), lazily exported package names (`lazy`), torchrun's environment (`torchrun`) and
the max all-reduce every rank's decision goes through (`collectives`). See
docs/ARCHITECTURE.md for the layers.
"""
