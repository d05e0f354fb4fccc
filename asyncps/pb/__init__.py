"""Generated protobuf and gRPC code for the asyncps wire contract (see proto/)."""
