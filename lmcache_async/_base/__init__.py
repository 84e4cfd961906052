"""The private leaves every tier may use: deadlines, timeouts, task helpers, host memory.

Nothing here knows the protocol."""
