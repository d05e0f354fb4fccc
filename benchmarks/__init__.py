"""Benchmark suite for asyncps.

``python -m benchmarks.bench`` (``make bench``) runs everything in one invocation: training
steps/s of asyncps against a plain Keras loop and TF's ``ParameterServerStrategy``
(:mod:`benchmarks.baselines`, :mod:`benchmarks.asyncps_runs`), model transfer against raw gRPC
streaming, and the scaling table (:mod:`benchmarks.scaling`). :mod:`benchmarks.load` is the
many-pushers load test of one shard.
"""
