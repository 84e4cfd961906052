"""The wire, sans-IO: frames, payloads, the server's config and events as data.

No socket and no event loop here."""
