"""The CUDA paths: loaded only for CUDA tensors (:mod:`.hooks`, :mod:`.copies`)."""
