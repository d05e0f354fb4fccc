"""The machine-learning side shared by workers and the chief: models, datasets, the code a user
brings, and TensorFlow's process setup. Shards never import it."""
