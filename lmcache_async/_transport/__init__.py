"""One server, bytes in and out: the ZMQ connection, its pending replies and streams,
the HTTP metadata, the SHM pool."""
