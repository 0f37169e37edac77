"""Data paths: how a large buffer reaches a peer beside its frame. What every path shares is
:mod:`mq.datapaths.base`; each path is a folder (``shm``, ``nvlink``, ``rdma``) with its
``path`` module (the :class:`~mq.datapaths.base.DataPath`) and its memory.
"""
