"""The blocking face's machinery: the loop thread and the generated blocking methods."""
