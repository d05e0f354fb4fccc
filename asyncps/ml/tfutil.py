"""TensorFlow process setup shared by the roles that run models (worker, chief)."""

from __future__ import annotations

import os


def quiet_tensorflow() -> None:
    """Silence TensorFlow's C++ start-up chatter (must run before importing tensorflow)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def limit_threads(threads: int) -> None:
    """Cap TensorFlow's thread pools so several processes on one machine do not fight over cores."""
    if threads <= 0:
        return
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
