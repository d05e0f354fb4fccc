"""Benchmark suite for asyncps.

:mod:`benchmarks.baselines` measures what asyncps is compared against, on the same machine and
with the same synthetic MLP workload: a plain single-process Keras training loop, TensorFlow's
own ``ParameterServerStrategy`` on a local cluster of separate processes, and raw gRPC byte
streaming (the transport ceiling). ``python -m benchmarks.baselines`` runs them all.
"""
