"""The manager's gRPC edge: the .proto and its generated modules, token authentication
(:mod:`manager.transport.auth`), the client every caller uses (:mod:`manager.transport.client`)
and the server (:mod:`manager.transport.server`), which converts between the wire and the domain."""
