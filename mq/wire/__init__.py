"""The wire format: a frame's contiguous layout (:mod:`mq.wire.frames`), payload encoding
(:mod:`mq.wire.codec`, TensorDicts in :mod:`mq.wire.tensordicts`), and the one parser of
frames from links that have not authenticated (:mod:`mq.wire.handshake`).
"""
