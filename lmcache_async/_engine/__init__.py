"""Running operations over a transport: the session, the operation runner and sequences,
copies, composition, the event stream."""
