"""The gRPC edge shared by the three services: protobuf <-> core translation and serving plumbing.

Core modules never import this package; services and the client do.
"""
