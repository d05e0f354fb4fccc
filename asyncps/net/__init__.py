"""Networking shared by every role: gRPC plumbing and error mapping (rpc), authentication and TLS
(security), per-role authorization (authz), bounded streams (streamguard)."""
