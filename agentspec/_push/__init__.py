"""Shard pushes: the wire format, the client-side pusher and the server-side intake."""
