"""The inline (no shared memory) tensor payload, per server generation: lmcache 0.5.6's pickled
tensor list (:mod:`.pickle_tensors`), 0.5.7's msgpack envelope (:mod:`.tensor_envelope`), and
the one place that picks between them (:mod:`.inline`)."""
