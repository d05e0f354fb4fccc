"""The wire: tensors as raw frames, the tensor codec, the shard's answers as domain types and the
one converter between protobuf messages and those types (proto.py). No network calls here."""
